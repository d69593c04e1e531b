// A cache of large freed CPU blocks under the tracking allocator (Note [Block cache]).
#pragma once

#include <cstddef>
#include <cstdint>

namespace fsdp::detail {

// Blocks of at least this many bytes go through the cache; smaller ones straight to malloc.
constexpr size_t kCachedBlockMin = size_t{1} << 20;

// The block size a request of `bytes` gets (large requests rounded up to whole pages, so the
// same tensor shape always maps to the same block size).
size_t block_size_for(size_t bytes);
// A block of block_size_for(bytes) bytes, 64-byte aligned: a cached one of that size when
// there is one, else a new one (c10::alloc_cpu; on failure the cache is emptied and it retries).
void* block_alloc(size_t bytes);
// Gives back a block from block_alloc(bytes): kept for reuse while the cache is under its
// limit (oldest blocks are freed first to make room), else freed.
void block_free(void* block, size_t bytes);

struct BlockCacheStats {
  int64_t limit_bytes = 0;   // FSDP_ALLOC_CACHE (default 512 MiB; 0 = off)
  int64_t cached_bytes = 0;  // held now, free for reuse
  int64_t hits = 0;          // large allocations served from the cache
  int64_t misses = 0;        // large allocations that went to malloc
};
BlockCacheStats block_cache_stats();
// Sets the limit (bytes; 0 turns the cache off and frees what it holds), overriding
// FSDP_ALLOC_CACHE.
void set_block_cache_limit(int64_t bytes);
// Frees every cached block (the memory goes back to the OS).
void block_cache_release();

}  // namespace fsdp::detail
