//===- ExprTest.cpp - Tests for moec::Expr --------------------------------===//

#include "compiler/support/Expr.h"

#include <catch2/catch.hpp>

#include <limits>

using moec::Bindings;
using moec::Expr;

namespace {

/// Parses `text`, failing the test when it does not parse.
Expr parseOk(const std::string &text) {
  std::string error;
  std::optional<Expr> expr = Expr::parse(text, &error);
  INFO("text: " << text << " error: " << error);
  REQUIRE(expr.has_value());
  return *expr;
}

/// Returns the parse error of `text`, failing the test when it parses.
std::string parseError(const std::string &text) {
  std::string error;
  std::optional<Expr> expr = Expr::parse(text, &error);
  INFO("text: " << text);
  REQUIRE_FALSE(expr.has_value());
  return error;
}

/// Evaluates `text` with `bindings`, failing the test on an error.
int64_t eval(const std::string &text, const Bindings &bindings = {}) {
  std::string error;
  std::optional<int64_t> value = parseOk(text).evaluate(bindings, &error);
  INFO("text: " << text << " error: " << error);
  REQUIRE(value.has_value());
  return *value;
}

/// Returns the evaluation error of `text`, failing the test when it succeeds.
std::string evalError(const std::string &text, const Bindings &bindings) {
  std::string error;
  std::optional<int64_t> value = parseOk(text).evaluate(bindings, &error);
  INFO("text: " << text);
  REQUIRE_FALSE(value.has_value());
  return error;
}

/// Returns the canonical form of `text`.
std::string canon(const std::string &text) { return parseOk(text).canonical(); }

} // namespace

TEST_CASE("literals and symbols evaluate", "[expr]") {
  CHECK(eval("0") == 0);
  CHECK(eval("42") == 42);
  CHECK(eval("  7  ") == 7);
  CHECK(eval("9223372036854775807") == std::numeric_limits<int64_t>::max());
  CHECK(eval("hidden_size", {{"hidden_size", 7168}}) == 7168);
  CHECK(eval("_x1", {{"_x1", 3}}) == 3);
  CHECK(eval("A_b9", {{"A_b9", -4}}) == -4);
}

TEST_CASE("precedence and associativity", "[expr]") {
  CHECK(eval("2 + 3 * 4") == 14);
  CHECK(eval("2 * 3 + 4") == 10);
  CHECK(eval("(2 + 3) * 4") == 20);
  CHECK(eval("10 - 4 - 3") == 3);  // (10 - 4) - 3, not 10 - (4 - 3) = 9
  CHECK(eval("64 / 8 / 2") == 4);  // (64 / 8) / 2, not 64 / (8 / 2) = 16
  CHECK(eval("24 / 4 * 2") == 12); // (24 / 4) * 2, not 24 / 8 = 3
  CHECK(eval("10 - 2 * 3") == 4);
  CHECK(eval("1 - 10") == -9);
  CHECK(eval("2*(3+(4-1))*2") == 24);
  CHECK(eval("((((5))))") == 5);
  CHECK(eval("\t2\n*\r3 ") == 6);
  CHECK(eval("2 * intermediate_size", {{"intermediate_size", 768}}) == 1536);
  CHECK(eval("num_experts * (per_expert_seq_to_other / split_value)",
             {{"num_experts", 16},
              {"per_expert_seq_to_other", 512},
              {"split_value", 128}}) == 64);
}

TEST_CASE("text, constants and symbols", "[expr]") {
  Expr e = parseOk("b * (a + b) / 2 + c_1");
  CHECK(e.text() == "b * (a + b) / 2 + c_1");
  CHECK(e.symbols() == std::vector<std::string>{"a", "b", "c_1"});
  CHECK_FALSE(e.isConstant());

  Expr k = parseOk("(3 + 4) * 2");
  CHECK(k.isConstant());
  CHECK(k.symbols().empty());

  Expr c = Expr::constant(1536);
  CHECK(c.text() == "1536");
  CHECK(c.isConstant());
  CHECK(c.evaluate({}, nullptr) == std::optional<int64_t>(1536));
  CHECK(c.canonical() == "1536");
  CHECK(Expr::constant(-5).text() == "-5");
  CHECK(Expr::constant(-5).evaluate({}, nullptr) == std::optional<int64_t>(-5));

  Expr d;
  CHECK(d.text() == "0");
  CHECK(d.evaluate({}, nullptr) == std::optional<int64_t>(0));

  // Copies share the tree and stay valid on their own.
  Expr copy = e;
  e = Expr::constant(1);
  CHECK(copy.text() == "b * (a + b) / 2 + c_1");
  CHECK(copy.evaluate({{"a", 1}, {"b", 3}, {"c_1", 10}}, nullptr) ==
        std::optional<int64_t>(16));
}

TEST_CASE("parse errors name the column and what was expected", "[expr]") {
  CHECK(parseError("") == "column 1: expected an operand");
  CHECK(parseError("   ") == "column 4: expected an operand");
  CHECK(parseError("hidden * ") == "column 10: expected an operand after '*'");
  CHECK(parseError("a + 2 * ") == "column 9: expected an operand after '*'");
  CHECK(parseError("a * * b") ==
        "column 5: expected an operand after '*', got '*'");
  CHECK(parseError("a / ") == "column 5: expected an operand after '/'");
  CHECK(parseError("a +") == "column 4: expected an operand after '+'");
  CHECK(parseError("a - )") ==
        "column 5: expected an operand after '-', got ')'");
  CHECK(parseError("-3") == "column 1: expected an operand, got '-'");
  CHECK(parseError("()") == "column 2: expected an operand after '(', got ')'");
  CHECK(parseError("(a + b") ==
        "column 7: expected ')' to close '(' at column 1");
  CHECK(parseError("2 * (a + b c") ==
        "column 12: expected ')' to close '(' at column 5, got 'c'");
  CHECK(parseError("a b") ==
        "column 3: expected an operator or the end of the expression, got "
        "'b'");
  CHECK(parseError("(a))") ==
        "column 4: expected an operator or the end of the expression, got "
        "')'");
  CHECK(parseError("2x") ==
        "column 2: expected an operator or the end of the expression, got "
        "'x'");
  CHECK(parseError("a $ b") ==
        "column 3: expected an operator or the end of the expression, got "
        "'$'");
  CHECK(parseError("a * $") ==
        "column 5: expected an operand after '*', got '$'");
  CHECK(parseError("1 + 9223372036854775808") ==
        "column 5: integer literal '9223372036854775808' does not fit in "
        "int64");

  // A null error pointer is allowed.
  CHECK_FALSE(Expr::parse("a +", nullptr).has_value());
}

TEST_CASE("nesting and length are bounded", "[expr]") {
  // At the bounds: parses and evaluates.
  const std::string deep = std::string(moec::kMaxExprDepth, '(') + "a" +
                           std::string(moec::kMaxExprDepth, ')');
  CHECK(parseOk(deep).evaluate({{"a", 7}}, nullptr) == 7);
  std::string sum = "1";
  for (int i = 0; i < moec::kMaxExprOperators; ++i)
    sum += " + 1";
  CHECK(parseOk(sum).evaluate({}, nullptr) == moec::kMaxExprOperators + 1);

  // Past them (10k nested parentheses, 20k flat terms): an error, not a
  // deep recursion.
  CHECK(parseError(std::string(10000, '(') + "a" + std::string(10000, ')')) ==
        "column " + std::to_string(moec::kMaxExprDepth + 1) +
            ": parentheses nested deeper than " + std::to_string(moec::kMaxExprDepth) +
            " levels");
  std::string flat = "a";
  for (int i = 0; i < 20000; ++i)
    flat += i % 2 ? "*a" : "+a";
  CHECK(parseError(flat).find("more than " + std::to_string(moec::kMaxExprOperators) +
                              " operators in one expression") != std::string::npos);
}

TEST_CASE("unknown symbols", "[expr]") {
  Bindings b = {{"hidden_size", 7168}, {"seq_size", 4096}};
  CHECK(evalError("hiden_size * 2", b) ==
        "unknown symbol 'hiden_size' (did you mean 'hidden_size'?)");
  CHECK(evalError("2 * seq_sise", b) ==
        "unknown symbol 'seq_sise' (did you mean 'seq_size'?)");
  // Edit distance 3: no suggestion.
  CHECK(evalError("hid_sz", b) == "unknown symbol 'hid_sz'");
  CHECK(evalError("x", {}) == "unknown symbol 'x'");
}

TEST_CASE("division must be exact and by non-zero", "[expr]") {
  Bindings b = {{"per_expert_seq_to_other", 500},
                {"split_value", 128},
                {"num_experts", 16},
                {"zero", 0}};
  CHECK(evalError("num_experts * (per_expert_seq_to_other / split_value)", b) ==
        "'per_expert_seq_to_other / split_value' does not divide: 500 is not "
        "a multiple of 128");
  CHECK(evalError("7 / 2", {}) ==
        "'7 / 2' does not divide: 7 is not a multiple of 2");
  CHECK(evalError("(1 - 8) / 2", {}) ==
        "'(1 - 8) / 2' does not divide: -7 is not a multiple of 2");
  CHECK(evalError("num_experts / zero", b) ==
        "division by zero in 'num_experts / zero': 'zero' is 0");
  CHECK(evalError("1 + 4 / (2 - 2)", {}) ==
        "division by zero in '4 / (2 - 2)': '2 - 2' is 0");
  CHECK(eval("(1 - 9) / 2") == -4);
  CHECK(eval("0 / 5") == 0);
}

TEST_CASE("int64 overflow", "[expr]") {
  Bindings b = {{"big", std::numeric_limits<int64_t>::max()},
                {"small", std::numeric_limits<int64_t>::min()},
                {"minus_one", -1}};
  CHECK(evalError("big + 1", b) ==
        "'big + 1' overflows int64: 9223372036854775807 + 1");
  CHECK(evalError("0 - big - 2", b) ==
        "'0 - big - 2' overflows int64: -9223372036854775807 - 2");
  CHECK(evalError("3 * ((big - 1) / 2)", b) ==
        "'3 * ((big - 1) / 2)' overflows int64: 3 * 4611686018427387903");
  CHECK(evalError("3000000000 * 4000000000", {}) ==
        "'3000000000 * 4000000000' overflows int64: 3000000000 * 4000000000");
  CHECK(evalError("small / minus_one", b) ==
        "'small / minus_one' overflows int64: -9223372036854775808 / -1");
  CHECK(eval("big - 1 + 1", b) == std::numeric_limits<int64_t>::max());
}

TEST_CASE("canonical forms agree for equal expressions", "[expr]") {
  CHECK(canon("2*a") == canon("a*2"));
  CHECK(canon("2*a") == canon("a+a"));
  CHECK(canon("a*b") == canon("b*a"));
  CHECK(canon("(a+b)*(a-b)") == canon("a*a - b*b"));
  CHECK(canon("a - a") == "0");
  CHECK(canon("2 * 3 + 1") == "7");
  CHECK(canon("(a*b)/c") == canon("(b*a)/c"));
  CHECK(canon("(a + b)/c + 1") == canon("1 + (b + a)/c"));
  CHECK(canon("x * (a/c)") == canon("(a/c) * x"));
  CHECK(canon("(2*a)/2") == canon("a"));
  CHECK(canon("(4*a + 6*b)/2") == canon("2*a + 3*b"));
  CHECK(canon("a/1") == canon("a"));
  CHECK(canon("6/3") == "2");
  CHECK(canon("(2*a)/(2*b)") == canon("a/b"));
  CHECK(canon("num_experts * (per_expert_seq_to_other / split_value)") ==
        canon("(per_expert_seq_to_other / split_value) * num_experts"));
  CHECK(canon("2 * intermediate_size") == "2*intermediate_size");
  CHECK(canon("b + 2*a*a - 3") == "2*a*a + b - 3");
  CHECK(canon("a/2") == "(a/2)");
  CHECK(Expr::constant(7).canonical() == canon("3 + 4"));
}

TEST_CASE("canonical forms differ for different expressions", "[expr]") {
  CHECK(canon("a*b") != canon("a+b"));
  CHECK(canon("a/2") != canon("a"));
  CHECK(canon("a/b") != canon("b/a"));
  CHECK(canon("(a/b)/c") != canon("a/(b/c)"));
  CHECK(canon("a/b*c") != canon("a/(b*c)"));
  CHECK(canon("a - b") != canon("b - a"));
  CHECK(canon("(a + 1)/2") != canon("a/2 + 1/2"));
  CHECK(canon("2*a") != canon("a*a"));
  CHECK(canon("a") != canon("A"));
  CHECK(canon("1") != canon("2"));
}

TEST_CASE("editDistance and closestName", "[expr]") {
  CHECK(moec::editDistance("", "") == 0);
  CHECK(moec::editDistance("abc", "") == 3);
  CHECK(moec::editDistance("hiden_size", "hidden_size") == 1);
  CHECK(moec::editDistance("kitten", "sitting") == 3);
  CHECK(moec::closestName("tpo_k", {"top_k", "tp"}) == "top_k");
  CHECK(moec::closestName("zzzz", {"top_k", "tp"}).empty());
  CHECK(moec::closestName("tp", {"tp", "ep"}) == "ep");
}
