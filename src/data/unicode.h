// Unicode helpers for the byte-level BPE tokenizer: UTF-8 decoding/encoding and the character
// classes its pre-tokenizer regexes use (\p{L}, \p{N}, \s).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::detail {

struct CodeRange {
  char32_t first, last;  // inclusive
};
// Generated tables (src/data/unicode_tables.cpp, scripts/gen_unicode_tables.py).
extern const CodeRange kLetter[];
extern const size_t kLetterCount;
extern const CodeRange kNumber[];
extern const size_t kNumberCount;

bool is_letter(char32_t c);      // general category L*
bool is_number(char32_t c);      // general category N*
bool is_whitespace(char32_t c);  // White_Space property (what \s matches in Unicode mode)

// Code points of a UTF-8 string; invalid bytes become U+FFFD (as Rust's from_utf8_lossy).
std::u32string utf8_decode(const std::string& s);
std::string utf8_encode(const std::u32string& s);
void utf8_append(std::string& out, char32_t c);

}  // namespace fsdp::detail
