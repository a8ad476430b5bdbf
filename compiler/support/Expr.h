//===- Expr.h - Integer expressions over named symbols ---------*- C++ -*-===//
//
// Symbolic integer expressions such as "2 * intermediate_size" or
// "num_experts * (per_expert_seq_to_other / split_value)". They describe
// tensor dims and task counts in terms of config values and are evaluated
// once the config is known.
//
// Grammar (whitespace is ignored):
//   expr    := term (('+' | '-') term)*
//   term    := primary (('*' | '/') primary)*
//   primary := INTEGER | IDENTIFIER | '(' expr ')'
//   INTEGER := [0-9]+                        (non-negative, fits in int64)
//   IDENTIFIER := [A-Za-z_][A-Za-z0-9_]*
//
// Operators are left associative; '*' and '/' bind tighter than '+' and '-'.
// Division must be exact when evaluated (evaluate()), or rounds up
// (evaluateRoundingUp(), for counts of tiles).
//
// An expression holds at most kMaxExprOperators binary operators and nests
// parentheses at most kMaxExprDepth deep: a graph needs a few of each, and
// the bounds keep the recursion over its tree shallow.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_COMPILER_SUPPORT_EXPR_H
#define MOEC_COMPILER_SUPPORT_EXPR_H

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace moec {

inline constexpr int kMaxExprOperators = 256;
inline constexpr int kMaxExprDepth = 32;

/// Values of the symbols an expression may use, keyed by symbol name.
using Bindings = std::map<std::string, int64_t, std::less<>>;

/// An immutable integer expression. Copies share the parsed tree, so an Expr
/// is cheap to copy and pass by value.
class Expr {
public:
  /// Creates the constant 0.
  Expr();

  /// Parses `text`. On failure returns std::nullopt and, when `error` is not
  /// null, sets *error to a message that names the 1-based column and what was
  /// expected, e.g. "column 7: expected an operand after '*'".
  static std::optional<Expr> parse(std::string_view text, std::string *error);

  /// Returns an expression that is the constant `value`; its text() is the
  /// decimal spelling of `value`. Lets callers that hold either a plain
  /// integer or an expression treat both as an Expr.
  static Expr constant(int64_t value);

  /// Returns the text the expression was parsed from (for constant(v), the
  /// decimal text of v).
  const std::string &text() const;

  /// Returns true if the expression uses no symbols.
  bool isConstant() const;

  /// Returns the symbols the expression uses, sorted and without duplicates.
  std::vector<std::string> symbols() const;

  /// Evaluates the expression with the symbol values in `bindings`.
  /// Returns std::nullopt and, when `error` is not null, sets *error on an
  /// unknown symbol (with a "did you mean" hint when a binding's name is
  /// within edit distance 2), a division by zero, a division that is not
  /// exact, or an int64 overflow. Messages quote the failing subexpression.
  std::optional<int64_t> evaluate(const Bindings &bindings,
                                  std::string *error) const;

  /// How evaluateRoundingUp() divides: a / b of positive a and b is the
  /// ceiling of the quotient (a count of tiles that cover a extent), exact
  /// division otherwise as evaluate().
  std::optional<int64_t> evaluateRoundingUp(const Bindings &bindings,
                                            std::string *error) const;

  /// Returns a canonical form of the expression: two expressions whose
  /// canonical() strings are equal have equal values for every binding.
  /// Division-free parts are normalised as polynomials with integer
  /// coefficients ("2*a", "a*2" and "a+a" agree; so do "a*b" and "b*a").
  /// A division whose divisor is a non-zero constant dividing every
  /// coefficient of the dividend is folded; any other division is kept as an
  /// opaque factor built from the canonical forms of its operands, so
  /// "(a*b)/c" and "(b*a)/c" agree.
  std::string canonical() const;

private:
  struct Impl;
  explicit Expr(std::shared_ptr<const Impl> impl);

  std::shared_ptr<const Impl> impl;
};

/// Returns the Levenshtein distance between `a` and `b` (insertions,
/// deletions and substitutions of single characters).
size_t editDistance(std::string_view a, std::string_view b);

/// Returns the candidate closest to `name` by editDistance() when that
/// distance is at most `maxDistance` and non-zero; ties go to the candidate
/// that comes first. Returns an empty string when there is none.
std::string closestName(std::string_view name,
                        const std::vector<std::string> &candidates,
                        size_t maxDistance = 2);

} // namespace moec

#endif // MOEC_COMPILER_SUPPORT_EXPR_H
