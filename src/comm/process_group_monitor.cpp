// Monitor: the heartbeat side channel behind collective timeout messages.
// See Note [Collective timeouts] in process_group_impl.cpp.
#include "comm/process_group_impl.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <map>
#include <sstream>

namespace fsdp::detail {

namespace {

std::string key_for(const std::string& uid, int world_rank) {
  return "fsdp/hb/" + uid + "/" + std::to_string(world_rank);
}

std::vector<uint8_t> encode(int64_t value) {
  auto s = std::to_string(value);
  return std::vector<uint8_t>(s.begin(), s.end());
}

std::string join(const std::vector<int>& v) {
  std::ostringstream out;
  for (size_t i = 0; i < v.size(); ++i) out << (i ? "," : "") << v[i];
  return out.str();
}

}  // namespace

Monitor::Monitor(c10::intrusive_ptr<c10d::Store> store, int world_rank,
                 std::chrono::milliseconds period)
    : store_(std::move(store)), world_rank_(world_rank), period_(period) {
  thread_ = std::thread([this] { loop(); });
}

Monitor::~Monitor() { stop(); }

void Monitor::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Monitor::add_group(const std::string& uid, std::shared_ptr<std::atomic<int64_t>> issued) {
  std::lock_guard<std::mutex> lock(mutex_);
  groups_.push_back(Entry{uid, std::move(issued), -1});
}

void Monitor::remove_group(const std::string& uid) {
  std::lock_guard<std::mutex> lock(mutex_);
  groups_.erase(std::remove_if(groups_.begin(), groups_.end(),
                               [&](const Entry& e) { return e.uid == uid; }),
                groups_.end());
}

void Monitor::publish_locked(const std::string& uid, int64_t value) {
  if (store_broken_) return;
  try {
    store_->set(key_for(uid, world_rank_), encode(value));
  } catch (const std::exception&) {
    // The store lives on rank 0; if it is gone the job is ending. Stop publishing quietly.
    store_broken_ = true;
  }
}

void Monitor::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    for (auto& e : groups_) {
      int64_t v = e.issued->load(std::memory_order_relaxed);
      if (v != e.published) {
        publish_locked(e.uid, v);
        e.published = v;
      }
    }
    cv_.wait_for(lock, period_, [&] { return stopping_; });
  }
}

std::string Monitor::describe_missing(const std::string& uid,
                                      const std::vector<int>& world_ranks, int64_t seq,
                                      std::chrono::milliseconds timeout) {
  try {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      // Shorter heartbeats from now on, so the others' values are fresh when we read.
      auto quick = std::max<std::chrono::milliseconds>(
          std::chrono::milliseconds(100),
          std::min<std::chrono::milliseconds>(std::chrono::seconds(1), timeout / 4));
      period_ = std::min(period_, quick);
      for (auto& e : groups_) {
        if (e.uid == uid) {
          int64_t v = e.issued->load(std::memory_order_relaxed);
          publish_locked(uid, v);
          e.published = v;
        }
      }
      if (store_broken_) return "(cannot tell which ranks are missing: the store on rank 0 is gone)";
    }
    cv_.notify_all();
    // Others publish at most one (old) period after a change: wait that long once.
    std::this_thread::sleep_for(std::min<std::chrono::milliseconds>(
        std::chrono::milliseconds(1100),
        std::max<std::chrono::milliseconds>(std::chrono::milliseconds(300), timeout / 2)));
    std::vector<int> behind;
    std::vector<std::string> details;
    std::vector<int> ahead;
    std::lock_guard<std::mutex> lock(mutex_);
    for (int r : world_ranks) {
      if (r == world_rank_) continue;
      auto key = key_for(uid, r);
      if (!store_->check({key})) {
        behind.push_back(r);
        details.push_back("rank " + std::to_string(r) + " never called a collective on this group");
        continue;
      }
      auto raw = store_->get(key);
      int64_t v = std::stoll(std::string(raw.begin(), raw.end()));
      int64_t their_seq = v >> 4;
      auto their_op = to_string(static_cast<CollectiveOp>(v & 15));
      if (their_seq < seq) {
        behind.push_back(r);
        details.push_back("rank " + std::to_string(r) + " last called " + their_op + " #" +
                          std::to_string(their_seq));
      } else if (their_seq > seq) {
        ahead.push_back(r);
        details.push_back("rank " + std::to_string(r) + " already called " + their_op + " #" +
                          std::to_string(their_seq) + ", so it skipped this one or called a "
                                                      "different collective");
      }
    }
    std::ostringstream out;
    if (!behind.empty()) out << "ranks " << join(behind) << " did not join";
    if (!ahead.empty()) {
      out << (behind.empty() ? "" : "; ") << "ranks " << join(ahead) << " are past it";
    }
    if (behind.empty() && ahead.empty()) {
      out << "every rank called it, so the transfer itself is stuck or very slow (overloaded "
             "host or network?)";
    } else {
      out << " (";
      for (size_t i = 0; i < details.size(); ++i) out << (i ? "; " : "") << details[i];
      out << ")";
    }
    return out.str();
  } catch (const std::exception& e) {
    return std::string("(cannot tell which ranks are missing: store query failed: ") + e.what() +
           ")";
  }
}

}  // namespace fsdp::detail
