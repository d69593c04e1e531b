// Monitor: the heartbeat side channel behind collective timeout messages.
// See Note [Collective timeouts] in process_group_impl.cpp.
#include "comm/process_group_impl.h"

#include "comm/rendezvous.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <iomanip>
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
    : store_(std::move(store)), world_rank_(world_rank), period_(period), initial_period_(period) {
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
    // Liveness, whatever the collectives do: a rank whose counter stops has lost its host, its
    // network or its process (Note [Collective timeouts]).
    publish_locked("alive", ++beats_);
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
    // Liveness counters now and after the wait: a rank whose counter did not move in more than
    // its heartbeat period is not running or not reachable.
    auto alive_values = [&] {
      std::map<int, std::string> v;
      std::lock_guard<std::mutex> lock(mutex_);
      for (int r : world_ranks) {
        if (r == world_rank_) continue;
        auto key = key_for("alive", r);
        if (store_->check({key})) {
          auto raw = store_->get(key);
          v[r] = std::string(raw.begin(), raw.end());
        }
      }
      return v;
    };
    const auto alive_before = alive_values();
    // Others publish at most one (old) period after a change: wait that long once, and longer
    // than one heartbeat period so a live rank's counter moves.
    const auto wait = std::max<std::chrono::milliseconds>(
        initial_period_ + std::chrono::milliseconds(500),
        std::min<std::chrono::milliseconds>(
            std::chrono::milliseconds(1100),
            std::max<std::chrono::milliseconds>(std::chrono::milliseconds(300), timeout / 2)));
    std::this_thread::sleep_for(wait);
    const auto alive_after = alive_values();
    std::vector<int> behind, ahead;
    std::map<int, std::string> details;
    std::lock_guard<std::mutex> lock(mutex_);
    for (int r : world_ranks) {
      if (r == world_rank_) continue;
      auto key = key_for(uid, r);
      if (!store_->check({key})) {
        behind.push_back(r);
        details[r] = "rank " + std::to_string(r) + " never called a collective on this group";
        continue;
      }
      auto raw = store_->get(key);
      int64_t v = std::stoll(std::string(raw.begin(), raw.end()));
      int64_t their_seq = v >> 4;
      auto their_op = to_string(static_cast<CollectiveOp>(v & 15));
      if (their_seq < seq) {
        behind.push_back(r);
        details[r] = "rank " + std::to_string(r) + " last called " + their_op + " #" +
                     std::to_string(their_seq);
      } else if (their_seq > seq) {
        ahead.push_back(r);
        details[r] = "rank " + std::to_string(r) + " already called " + their_op + " #" +
                     std::to_string(their_seq) + ", so it skipped this one or called a "
                                                 "different collective";
      }
    }
    // Behind and silent: what they last called says nothing (they stopped); the survivors'
    // positions are a consequence. Name them, where they run, and why they may be gone.
    std::vector<int> silent, waiting;
    for (int r : behind) {
      auto b = alive_before.find(r), a = alive_after.find(r);
      const bool stopped =
          b != alive_before.end() && a != alive_after.end() && a->second == b->second;
      (stopped ? silent : waiting).push_back(r);
    }
    auto ranks_word = [](const std::vector<int>& v) { return v.size() == 1 ? "rank " : "ranks "; };
    std::ostringstream out;
    if (!silent.empty()) {
      const std::string where = hosts_of_ranks(silent);
      out << ranks_word(silent) << join(silent) << (silent.size() == 1 ? " has" : " have")
          << " not been heard from for " << std::fixed << std::setprecision(1)
          << std::chrono::duration<double>(wait).count() << " s"
          << (where.empty() ? std::string() : " (" + where + ")") << ": " << kSilentRanks;
      if (waiting.empty()) return out.str();
      out << "; ";
      ahead.clear();
    }
    if (!waiting.empty()) out << "ranks " << join(waiting) << " did not join";
    if (!ahead.empty()) {
      out << (waiting.empty() ? "" : "; ") << "ranks " << join(ahead) << " are past it";
    }
    if (behind.empty() && ahead.empty()) {
      out << "every rank called it, so the transfer itself is stuck or very slow (overloaded "
             "host or network?)";
      return out.str();
    }
    std::vector<std::string> shown;
    for (int r : waiting) shown.push_back(details[r]);
    for (int r : ahead) shown.push_back(details[r]);
    if (!shown.empty()) {
      out << " (";
      for (size_t i = 0; i < shown.size(); ++i) out << (i ? "; " : "") << shown[i];
      out << ")";
    }
    return out.str();
  } catch (const std::exception& e) {
    return std::string("(cannot tell which ranks are missing: store query failed: ") + e.what() +
           ")";
  }
}

}  // namespace fsdp::detail
