#include <gtest/gtest.h>

#include "fsdp/memory.h"

TEST(Bytes, ParsesUnits) {
  EXPECT_EQ(fsdp::parse_bytes("12GiB"), 12LL * 1024 * 1024 * 1024);
  EXPECT_EQ(fsdp::parse_bytes("800MB"), 800LL * 1000 * 1000);
  EXPECT_EQ(fsdp::parse_bytes("4096"), 4096);
  EXPECT_EQ(fsdp::parse_bytes("1.5 KiB"), 1536);
  EXPECT_THROW(fsdp::parse_bytes("lots"), c10::Error);
  EXPECT_THROW(fsdp::parse_bytes("3 parsecs"), c10::Error);
}

TEST(Bytes, Formats) {
  EXPECT_EQ(fsdp::format_bytes(512), "512 B");
  EXPECT_EQ(fsdp::format_bytes(1536), "1.50 KiB");
}
