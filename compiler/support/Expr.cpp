//===- Expr.cpp - Integer expressions over named symbols ------------------===//

#include "compiler/support/Expr.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <set>
#include <utility>

namespace moec {
namespace {

/// One node of a parsed expression tree. Nodes are immutable once built.
struct Node {
  enum class Kind { Const, Sym, Add, Sub, Mul, Div };

  Kind kind = Kind::Const;
  int64_t value = 0;
  std::string name;
  std::shared_ptr<const Node> lhs;
  std::shared_ptr<const Node> rhs;
  /// The node's extent in the expression text, [begin, end).
  size_t begin = 0;
  size_t end = 0;
};

using NodePtr = std::shared_ptr<const Node>;

/// Returns the spelling of a binary operator kind.
char opChar(Node::Kind kind) {
  switch (kind) {
  case Node::Kind::Add:
    return '+';
  case Node::Kind::Sub:
    return '-';
  case Node::Kind::Mul:
    return '*';
  case Node::Kind::Div:
    return '/';
  default:
    return '?';
  }
}

/// Returns true if `c` may start an identifier.
bool isIdentStart(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}

/// Returns true if `c` may continue an identifier.
bool isIdentChar(char c) { return isIdentStart(c) || (c >= '0' && c <= '9'); }

/// Returns true if `c` is a decimal digit.
bool isDigit(char c) { return c >= '0' && c <= '9'; }

/// Returns true if `c` is whitespace the grammar ignores.
bool isSpace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' ||
         c == '\v';
}

/// Describes the character at a position for error messages.
std::string describeChar(char c) {
  if (static_cast<unsigned char>(c) < 0x20 ||
      static_cast<unsigned char>(c) >= 0x7f) {
    char buf[16];
    snprintf(buf, sizeof(buf), "byte 0x%02x",
             static_cast<unsigned>(static_cast<unsigned char>(c)));
    return buf;
  }
  return std::string("'") + c + "'";
}

/// A recursive-descent parser over the grammar in Expr.h.
class Parser {
public:
  explicit Parser(std::string_view text) : text(text) {}

  /// Parses the whole text; returns null and sets `error` on failure.
  NodePtr parseAll() {
    std::optional<Parsed> result = parseExpr("");
    if (!result)
      return nullptr;
    skipSpace();
    if (pos != text.size()) {
      fail(pos, "expected an operator or the end of the expression, got " +
                    describeChar(text[pos]));
      return nullptr;
    }
    return result->node;
  }

  std::string error;

private:
  int depth = 0;     // of the parentheses being parsed
  int operators = 0; // binary operators parsed so far

  /// A parsed subexpression with its full syntactic extent (including any
  /// enclosing parentheses).
  struct Parsed {
    NodePtr node;
    size_t begin;
    size_t end;
  };

  void skipSpace() {
    while (pos < text.size() && isSpace(text[pos]))
      ++pos;
  }

  void fail(size_t at, const std::string &message) {
    error = "column " + std::to_string(at + 1) + ": " + message;
  }

  /// Counts a binary operator against kMaxExprOperators; fails past it.
  bool countOperator(size_t at) {
    if (++operators <= kMaxExprOperators)
      return true;
    fail(at, "more than " + std::to_string(kMaxExprOperators) +
                 " operators in one expression");
    return false;
  }

  static NodePtr makeBinary(Node::Kind kind, const Parsed &lhs,
                            const Parsed &rhs) {
    auto node = std::make_shared<Node>();
    node->kind = kind;
    node->lhs = lhs.node;
    node->rhs = rhs.node;
    node->begin = lhs.begin;
    node->end = rhs.end;
    return node;
  }

  /// expr := term (('+' | '-') term)*
  std::optional<Parsed> parseExpr(const std::string &context) {
    std::optional<Parsed> lhs = parseTerm(context);
    if (!lhs)
      return std::nullopt;
    while (true) {
      skipSpace();
      if (pos >= text.size() || (text[pos] != '+' && text[pos] != '-'))
        return lhs;
      if (!countOperator(pos))
        return std::nullopt;
      char op = text[pos++];
      std::optional<Parsed> rhs = parseTerm(std::string("'") + op + "'");
      if (!rhs)
        return std::nullopt;
      Node::Kind kind = op == '+' ? Node::Kind::Add : Node::Kind::Sub;
      lhs = Parsed{makeBinary(kind, *lhs, *rhs), lhs->begin, rhs->end};
    }
  }

  /// term := primary (('*' | '/') primary)*
  std::optional<Parsed> parseTerm(const std::string &context) {
    std::optional<Parsed> lhs = parsePrimary(context);
    if (!lhs)
      return std::nullopt;
    while (true) {
      skipSpace();
      if (pos >= text.size() || (text[pos] != '*' && text[pos] != '/'))
        return lhs;
      if (!countOperator(pos))
        return std::nullopt;
      char op = text[pos++];
      std::optional<Parsed> rhs = parsePrimary(std::string("'") + op + "'");
      if (!rhs)
        return std::nullopt;
      Node::Kind kind = op == '*' ? Node::Kind::Mul : Node::Kind::Div;
      lhs = Parsed{makeBinary(kind, *lhs, *rhs), lhs->begin, rhs->end};
    }
  }

  /// primary := INTEGER | IDENTIFIER | '(' expr ')'
  /// `context` names what precedes the operand ("'*'", "'('"), or is empty.
  std::optional<Parsed> parsePrimary(const std::string &context) {
    skipSpace();
    size_t start = pos;
    if (pos < text.size() && isDigit(text[pos])) {
      int64_t value = 0;
      bool overflow = false;
      while (pos < text.size() && isDigit(text[pos])) {
        int64_t digit = text[pos] - '0';
        if (__builtin_mul_overflow(value, int64_t(10), &value) ||
            __builtin_add_overflow(value, digit, &value))
          overflow = true;
        ++pos;
      }
      if (overflow) {
        fail(start, "integer literal '" +
                        std::string(text.substr(start, pos - start)) +
                        "' does not fit in int64");
        return std::nullopt;
      }
      auto node = std::make_shared<Node>();
      node->kind = Node::Kind::Const;
      node->value = value;
      node->begin = start;
      node->end = pos;
      return Parsed{node, start, pos};
    }
    if (pos < text.size() && isIdentStart(text[pos])) {
      while (pos < text.size() && isIdentChar(text[pos]))
        ++pos;
      auto node = std::make_shared<Node>();
      node->kind = Node::Kind::Sym;
      node->name = std::string(text.substr(start, pos - start));
      node->begin = start;
      node->end = pos;
      return Parsed{node, start, pos};
    }
    if (pos < text.size() && text[pos] == '(') {
      if (++depth > kMaxExprDepth) {
        fail(pos, "parentheses nested deeper than " + std::to_string(kMaxExprDepth) +
                      " levels");
        return std::nullopt;
      }
      ++pos;
      std::optional<Parsed> inner = parseExpr("'('");
      --depth;
      if (!inner)
        return std::nullopt;
      skipSpace();
      if (pos >= text.size() || text[pos] != ')') {
        std::string message =
            "expected ')' to close '(' at column " + std::to_string(start + 1);
        if (pos < text.size())
          message += ", got " + describeChar(text[pos]);
        fail(pos, message);
        return std::nullopt;
      }
      ++pos;
      return Parsed{inner->node, start, pos};
    }
    std::string message = "expected an operand";
    if (!context.empty())
      message += " after " + context;
    if (pos < text.size())
      message += ", got " + describeChar(text[pos]);
    fail(pos, message);
    return std::nullopt;
  }

  std::string_view text;
  size_t pos = 0;
};

/// Collects the symbol names used under `node`.
void collectSymbols(const Node &node, std::set<std::string> &out) {
  if (node.kind == Node::Kind::Sym) {
    out.insert(node.name);
    return;
  }
  if (node.lhs)
    collectSymbols(*node.lhs, out);
  if (node.rhs)
    collectSymbols(*node.rhs, out);
}

//===----------------------------------------------------------------------===//
// Canonical form
//===----------------------------------------------------------------------===//

/// A product of atoms (symbol names or opaque division terms), sorted.
using Monomial = std::vector<std::string>;
/// A polynomial: monomials with non-zero integer coefficients.
using Poly = std::map<Monomial, int64_t>;

/// Adds `coeff * mono` into `poly`; returns false on overflow.
bool addTerm(Poly &poly, const Monomial &mono, int64_t coeff) {
  auto it = poly.find(mono);
  if (it == poly.end()) {
    if (coeff != 0)
      poly.emplace(mono, coeff);
    return true;
  }
  int64_t sum;
  if (__builtin_add_overflow(it->second, coeff, &sum))
    return false;
  if (sum == 0)
    poly.erase(it);
  else
    it->second = sum;
  return true;
}

/// Returns true if `poly` is a constant; sets *value to it.
bool polyConstant(const Poly &poly, int64_t *value) {
  if (poly.empty()) {
    *value = 0;
    return true;
  }
  if (poly.size() == 1 && poly.begin()->first.empty()) {
    *value = poly.begin()->second;
    return true;
  }
  return false;
}

/// Prints the magnitude of `value` (also for INT64_MIN).
std::string magnitude(int64_t value) {
  uint64_t mag = value < 0 ? uint64_t(0) - uint64_t(value) : uint64_t(value);
  return std::to_string(mag);
}

/// Renders a polynomial: terms by decreasing degree, then by monomial; the
/// constant term last.
std::string renderPoly(const Poly &poly) {
  if (poly.empty())
    return "0";
  std::vector<std::pair<Monomial, int64_t>> terms(poly.begin(), poly.end());
  std::stable_sort(terms.begin(), terms.end(),
                   [](const auto &a, const auto &b) {
                     if (a.first.size() != b.first.size())
                       return a.first.size() > b.first.size();
                     return a.first < b.first;
                   });
  std::string out;
  bool first = true;
  for (const auto &[mono, coeff] : terms) {
    if (first)
      out += coeff < 0 ? "-" : "";
    else
      out += coeff < 0 ? " - " : " + ";
    first = false;
    std::string body;
    if (mono.empty() || (coeff != 1 && coeff != -1))
      body = magnitude(coeff);
    for (const std::string &atom : mono) {
      if (!body.empty())
        body += "*";
      body += atom;
    }
    out += body;
  }
  return out;
}

/// Renders a division operand, parenthesised unless it is a non-negative
/// constant or a single atom (a symbol, or a division or overflow atom, which
/// carry their own brackets).
std::string renderOperand(const Poly &poly) {
  int64_t value;
  if (polyConstant(poly, &value) && value >= 0)
    return std::to_string(value);
  if (poly.size() == 1 && poly.begin()->second == 1 &&
      poly.begin()->first.size() == 1)
    return poly.begin()->first.front();
  return "(" + renderPoly(poly) + ")";
}

/// Renders the tree below `node` fully parenthesised, without normalising.
std::string structural(const Node &node) {
  switch (node.kind) {
  case Node::Kind::Const:
    return std::to_string(node.value);
  case Node::Kind::Sym:
    return node.name;
  default:
    return "(" + structural(*node.lhs) + " " + opChar(node.kind) + " " +
           structural(*node.rhs) + ")";
  }
}

/// Returns a polynomial consisting of the single atom `atom`.
Poly atomPoly(const std::string &atom) { return Poly{{Monomial{atom}, 1}}; }

std::optional<Poly> tryPoly(const Node &node);

/// Returns the polynomial of `node`; a subexpression whose normalisation
/// overflows int64 becomes an opaque atom of its structural form.
Poly toPoly(const Node &node) {
  if (std::optional<Poly> poly = tryPoly(node))
    return std::move(*poly);
  return atomPoly("[" + structural(node) + "]");
}

/// Multiplies two polynomials; returns std::nullopt on overflow.
std::optional<Poly> multiply(const Poly &a, const Poly &b) {
  Poly result;
  for (const auto &[ma, ca] : a) {
    for (const auto &[mb, cb] : b) {
      int64_t coeff;
      if (__builtin_mul_overflow(ca, cb, &coeff))
        return std::nullopt;
      Monomial mono = ma;
      mono.insert(mono.end(), mb.begin(), mb.end());
      std::sort(mono.begin(), mono.end());
      if (!addTerm(result, mono, coeff))
        return std::nullopt;
    }
  }
  return result;
}

/// Divides exactly-divisible coefficients by `divisor`; std::nullopt when a
/// coefficient is not a multiple of it or the quotient overflows.
std::optional<Poly> divideCoefficients(const Poly &poly, int64_t divisor) {
  Poly result;
  for (const auto &[mono, coeff] : poly) {
    if (divisor == -1 && coeff == std::numeric_limits<int64_t>::min())
      return std::nullopt;
    if (coeff % divisor != 0)
      return std::nullopt;
    result.emplace(mono, coeff / divisor);
  }
  return result;
}

/// Normalises `lhs / rhs`.
std::optional<Poly> dividePoly(Poly lhs, Poly rhs) {
  int64_t divisor;
  if (polyConstant(rhs, &divisor) && divisor != 0) {
    if (std::optional<Poly> folded = divideCoefficients(lhs, divisor))
      return folded;
  }
  if (!rhs.empty()) {
    // Remove the common content of both sides: (g*p)/(g*q) == p/q, with the
    // same exactness, for every binding.
    uint64_t g = 0;
    auto absValue = [](int64_t v) {
      return v < 0 ? uint64_t(0) - uint64_t(v) : uint64_t(v);
    };
    for (const auto &term : lhs)
      g = std::gcd(g, absValue(term.second));
    for (const auto &term : rhs)
      g = std::gcd(g, absValue(term.second));
    if (g > 1 && g <= uint64_t(std::numeric_limits<int64_t>::max())) {
      lhs = *divideCoefficients(lhs, int64_t(g));
      rhs = *divideCoefficients(rhs, int64_t(g));
    }
    // Make the divisor's leading coefficient positive: p/q == (-p)/(-q).
    std::string rendered = renderPoly(rhs);
    if (!rendered.empty() && rendered.front() == '-') {
      std::optional<Poly> negLhs = divideCoefficients(lhs, -1);
      std::optional<Poly> negRhs = divideCoefficients(rhs, -1);
      if (negLhs && negRhs) {
        lhs = std::move(*negLhs);
        rhs = std::move(*negRhs);
      }
    }
    if (polyConstant(rhs, &divisor) && divisor == 1)
      return lhs;
  }
  return atomPoly("(" + renderOperand(lhs) + "/" + renderOperand(rhs) + ")");
}

std::optional<Poly> tryPoly(const Node &node) {
  switch (node.kind) {
  case Node::Kind::Const: {
    Poly poly;
    if (node.value != 0)
      poly.emplace(Monomial{}, node.value);
    return poly;
  }
  case Node::Kind::Sym:
    return atomPoly(node.name);
  case Node::Kind::Add:
  case Node::Kind::Sub: {
    Poly result = toPoly(*node.lhs);
    Poly rhs = toPoly(*node.rhs);
    for (const auto &[mono, coeff] : rhs) {
      int64_t term = coeff;
      if (node.kind == Node::Kind::Sub &&
          __builtin_sub_overflow(int64_t(0), coeff, &term))
        return std::nullopt;
      if (!addTerm(result, mono, term))
        return std::nullopt;
    }
    return result;
  }
  case Node::Kind::Mul:
    return multiply(toPoly(*node.lhs), toPoly(*node.rhs));
  case Node::Kind::Div:
    return dividePoly(toPoly(*node.lhs), toPoly(*node.rhs));
  }
  return std::nullopt;
}

} // namespace

//===----------------------------------------------------------------------===//
// Expr
//===----------------------------------------------------------------------===//

struct Expr::Impl {
  std::string text;
  NodePtr root;
};

Expr::Expr() : Expr(constant(0)) {}

Expr::Expr(std::shared_ptr<const Impl> impl) : impl(std::move(impl)) {}

std::optional<Expr> Expr::parse(std::string_view text, std::string *error) {
  Parser parser(text);
  NodePtr root = parser.parseAll();
  if (!root) {
    if (error)
      *error = parser.error;
    return std::nullopt;
  }
  auto impl = std::make_shared<Impl>();
  impl->text = std::string(text);
  impl->root = std::move(root);
  return Expr(std::move(impl));
}

Expr Expr::constant(int64_t value) {
  auto node = std::make_shared<Node>();
  node->kind = Node::Kind::Const;
  node->value = value;
  auto impl = std::make_shared<Impl>();
  impl->text = std::to_string(value);
  node->begin = 0;
  node->end = impl->text.size();
  impl->root = std::move(node);
  return Expr(std::move(impl));
}

const std::string &Expr::text() const { return impl->text; }

bool Expr::isConstant() const { return symbols().empty(); }

std::vector<std::string> Expr::symbols() const {
  std::set<std::string> names;
  collectSymbols(*impl->root, names);
  return std::vector<std::string>(names.begin(), names.end());
}

namespace {

/// Evaluates `node`; `text` is the whole expression text for messages.
std::optional<int64_t> evaluateNode(const Node &node, const std::string &text, bool roundUp,
                                    const Bindings &bindings,
                                    std::string *error) {
  auto setError = [&](const std::string &message) {
    if (error)
      *error = message;
    return std::nullopt;
  };
  switch (node.kind) {
  case Node::Kind::Const:
    return node.value;
  case Node::Kind::Sym: {
    auto it = bindings.find(node.name);
    if (it != bindings.end())
      return it->second;
    std::vector<std::string> names;
    for (const auto &binding : bindings)
      names.push_back(binding.first);
    std::string message = "unknown symbol '" + node.name + "'";
    std::string suggestion = closestName(node.name, names);
    if (!suggestion.empty())
      message += " (did you mean '" + suggestion + "'?)";
    return setError(message);
  }
  default:
    break;
  }
  std::optional<int64_t> lhs = evaluateNode(*node.lhs, text, roundUp, bindings, error);
  if (!lhs)
    return std::nullopt;
  std::optional<int64_t> rhs = evaluateNode(*node.rhs, text, roundUp, bindings, error);
  if (!rhs)
    return std::nullopt;
  std::string quoted =
      "'" + text.substr(node.begin, node.end - node.begin) + "'";
  std::string overflow = quoted + " overflows int64: " + std::to_string(*lhs) +
                         " " + opChar(node.kind) + " " + std::to_string(*rhs);
  int64_t result = 0;
  switch (node.kind) {
  case Node::Kind::Add:
    if (__builtin_add_overflow(*lhs, *rhs, &result))
      return setError(overflow);
    return result;
  case Node::Kind::Sub:
    if (__builtin_sub_overflow(*lhs, *rhs, &result))
      return setError(overflow);
    return result;
  case Node::Kind::Mul:
    if (__builtin_mul_overflow(*lhs, *rhs, &result))
      return setError(overflow);
    return result;
  case Node::Kind::Div:
    if (*rhs == 0)
      return setError(
          "division by zero in " + quoted + ": '" +
          text.substr(node.rhs->begin, node.rhs->end - node.rhs->begin) +
          "' is 0");
    if (*lhs == std::numeric_limits<int64_t>::min() && *rhs == -1)
      return setError(overflow);
    if (roundUp && *lhs > 0 && *rhs > 0)
      return *lhs / *rhs + (*lhs % *rhs != 0);
    if (*lhs % *rhs != 0)
      return setError(quoted + " does not divide: " + std::to_string(*lhs) +
                      " is not a multiple of " + std::to_string(*rhs));
    return *lhs / *rhs;
  default:
    return setError("invalid expression node");
  }
}

} // namespace

std::optional<int64_t> Expr::evaluate(const Bindings &bindings,
                                      std::string *error) const {
  return evaluateNode(*impl->root, impl->text, false, bindings, error);
}

std::optional<int64_t> Expr::evaluateRoundingUp(const Bindings &bindings,
                                                std::string *error) const {
  return evaluateNode(*impl->root, impl->text, true, bindings, error);
}

std::string Expr::canonical() const { return renderPoly(toPoly(*impl->root)); }

//===----------------------------------------------------------------------===//
// Name suggestions
//===----------------------------------------------------------------------===//

size_t editDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j)
    row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t above = row[j];
      size_t substitute = diagonal + (a[i - 1] == b[j - 1] ? 0 : 1);
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, substitute});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::string closestName(std::string_view name,
                        const std::vector<std::string> &candidates,
                        size_t maxDistance) {
  std::string best;
  size_t bestDistance = maxDistance + 1;
  for (const std::string &candidate : candidates) {
    size_t distance = editDistance(name, candidate);
    if (distance == 0 || distance >= bestDistance)
      continue;
    best = candidate;
    bestDistance = distance;
  }
  return best;
}

} // namespace moec
