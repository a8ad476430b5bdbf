//===- Table.h - a text table, columns as wide as their widest cell ----*- C++ -*-===//

#ifndef MOEC_COMPILER_INSPECT_TABLE_H
#define MOEC_COMPILER_INSPECT_TABLE_H

#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace moec::inspect {

/// A text table: rows of cells, printed with each column as wide as its
/// widest cell, numeric columns right-aligned.
class Table {
public:
  /// `rightAligned[i]` says whether column i is right-aligned.
  Table(std::vector<std::string> header, std::vector<bool> rightAligned)
      : right(std::move(rightAligned)) {
    rows.push_back(std::move(header));
  }

  void add(std::vector<std::string> row) { rows.push_back(std::move(row)); }

  /// Renders the table, each line indented by `indent` spaces.
  std::string render(size_t indent) const {
    std::vector<size_t> width(rows.front().size(), 0);
    for (const auto &row : rows)
      for (size_t i = 0; i < row.size() && i < width.size(); ++i)
        width[i] = std::max(width[i], displayWidth(row[i]));
    std::string out;
    for (const auto &row : rows) {
      std::string line(indent, ' ');
      for (size_t i = 0; i < row.size() && i < width.size(); ++i) {
        size_t pad = width[i] - displayWidth(row[i]);
        bool last = i + 1 == row.size();
        if (i < right.size() && right[i])
          line += std::string(pad, ' ') + row[i];
        else
          line += row[i] + (last ? "" : std::string(pad, ' '));
        if (!last)
          line += "  ";
      }
      while (!line.empty() && line.back() == ' ')
        line.pop_back();
      out += line + "\n";
    }
    return out;
  }

private:
  /// The number of characters of UTF-8 text.
  static size_t displayWidth(const std::string &text) {
    size_t n = 0;
    for (unsigned char c : text)
      n += (c & 0xC0) != 0x80;
    return n;
  }

  std::vector<std::vector<std::string>> rows;
  std::vector<bool> right;
};

} // namespace moec::inspect

#endif // MOEC_COMPILER_INSPECT_TABLE_H
