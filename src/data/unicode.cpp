// UTF-8 and character classes. See unicode.h.
#include "data/unicode.h"

#include <algorithm>

namespace fsdp::detail {
namespace {

bool in_ranges(const CodeRange* ranges, size_t count, char32_t c) {
  // First range whose last >= c.
  const CodeRange* end = ranges + count;
  const CodeRange* it = std::lower_bound(
      ranges, end, c, [](const CodeRange& r, char32_t v) { return r.last < v; });
  return it != end && it->first <= c;
}

}  // namespace

bool is_letter(char32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
  return in_ranges(kLetter, kLetterCount, c);
}

bool is_number(char32_t c) {
  if (c < 0x80) return c >= '0' && c <= '9';
  return in_ranges(kNumber, kNumberCount, c);
}

bool is_whitespace(char32_t c) {
  switch (c) {
    case 0x09: case 0x0A: case 0x0B: case 0x0C: case 0x0D: case 0x20: case 0x85: case 0xA0:
    case 0x1680: case 0x2028: case 0x2029: case 0x202F: case 0x205F: case 0x3000:
      return true;
    default:
      return c >= 0x2000 && c <= 0x200A;
  }
}

std::u32string utf8_decode(const std::string& s) {
  std::u32string out;
  out.reserve(s.size());
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char b = p[i];
    int len = 0;
    char32_t c = 0;
    if (b < 0x80) {
      len = 1, c = b;
    } else if ((b & 0xE0) == 0xC0) {
      len = 2, c = b & 0x1F;
    } else if ((b & 0xF0) == 0xE0) {
      len = 3, c = b & 0x0F;
    } else if ((b & 0xF8) == 0xF0) {
      len = 4, c = b & 0x07;
    }
    bool ok = len > 0 && i + len <= n;
    for (int k = 1; ok && k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) ok = false;
      c = (c << 6) | (p[i + k] & 0x3F);
    }
    // Overlong forms, surrogates and out-of-range values are invalid too.
    if (ok && ((len == 2 && c < 0x80) || (len == 3 && c < 0x800) || (len == 4 && c < 0x10000) ||
               (c >= 0xD800 && c <= 0xDFFF) || c > 0x10FFFF)) {
      ok = false;
    }
    if (!ok) {
      out.push_back(0xFFFD);
      ++i;
      continue;
    }
    out.push_back(c);
    i += len;
  }
  return out;
}

void utf8_append(std::string& out, char32_t c) {
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

std::string utf8_encode(const std::u32string& s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) utf8_append(out, c);
  return out;
}

}  // namespace fsdp::detail
