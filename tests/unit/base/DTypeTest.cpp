//===- DTypeTest.cpp - Tests for the element types' table -----------------===//

#include "base/DType.h"

#include <catch2/catch.hpp>

#include <string>

using namespace moec;

TEST_CASE("each element type finds its own entry; a value outside the enum none", "[dtype]") {
  const struct {
    DType dtype;
    std::string name;
    uint32_t size;
  } expected[] = {{DType::F32, "f32", 4}, {DType::BF16, "bf16", 2},     {DType::I32, "i32", 4},
                  {DType::I64, "i64", 8}, {DType::F8E4M3, "f8e4m3", 1}, {DType::I8, "i8", 1},
                  {DType::I4, "i4", 0}};
  for (const auto &e : expected) {
    INFO(e.name);
    const DTypeInfo *info = dtypeInfo(e.dtype);
    REQUIRE(info != nullptr);
    CHECK(info->dtype == e.dtype);
    CHECK(dtypeName(e.dtype) == e.name);
    CHECK(dtypeSize(e.dtype) == e.size);
  }
  for (int value : {0, 8, 9, 255}) {
    INFO("value " << value);
    const DType dtype = static_cast<DType>(value);
    CHECK(dtypeInfo(dtype) == nullptr);
    CHECK(dtypeName(dtype) == std::string("unknown"));
    CHECK(dtypeSize(dtype) == 0);
  }
  // Usable where a constant is needed, as before.
  static_assert(dtypeSize(DType::BF16) == 2 && dtypeInfo(DType(0)) == nullptr);
  CHECK(configDTypeName(DType::F8E4M3) == std::string("fp8_e4m3"));
  CHECK(parseDType("bf16") == DType::BF16);
}
