// Monitor: the heartbeat side channel behind collective timeout messages.
// See Note [Collective timeouts] in process_group_impl.cpp.
#include "comm/process_group_impl.h"

#include "comm/rendezvous.h"
#include "common/text.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <iomanip>
#include <map>
#include <optional>
#include <thread>
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

// Note [Culprit path deadlines]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The store the heartbeats go through is served by rank 0. A stopped rank 0 (SIGSTOP, a
// debugger, a frozen VM) keeps its sockets open, so a store read then neither answers nor fails:
// it blocks for as long as the socket allows, which may be for ever. Nothing on the timeout path
// may depend on that. So:
//  - only the heartbeat thread talks to the store; it never holds the Monitor's lock during a
//    store call, and its state is shared (State), so a thread stuck in a store call can be left
//    behind at shutdown instead of joined (stop() waits a few seconds at most);
//  - describe_missing asks the heartbeat thread for the values it needs (a snapshot) and waits
//    for the answer until answer_deadline(timeout) (timeout / 4, between 1 and 3 s). A store
//    that does not answer in that time means its host is not running or not reachable: the
//    message names rank 0 as not heard from, the same words as for any silent rank;
//  - a snapshot still outstanding from an earlier timeout makes later ones fail at once.
// The whole culprit path therefore ends within two deadlines and one heartbeat period, and the
// rank fails with a message instead of hanging. The launchers then end the job: fsdp-run's and
// fsdp::launch's supervisor resume a stopped rank after SIGTERM so that it ends (Note
// [Supervisor]); a rank spawned by fsdp::launch whose parent (rank 0) is stopped ends its parent
// (Note [Failure notice]); mpirun ends all ranks when one exits non-zero.

struct Monitor::State {
  State(c10::intrusive_ptr<c10d::Store> s, int r, std::chrono::milliseconds p)
      : store(std::move(s)), world_rank(r), period(p) {}
  c10::intrusive_ptr<c10d::Store> store;  // used by the heartbeat thread only
  const int world_rank;
  std::mutex mutex;  // guards everything below
  std::condition_variable cv;
  struct Entry {
    std::string uid;
    std::shared_ptr<std::atomic<int64_t>> issued;
    int64_t published = -1;
  };
  std::vector<Entry> groups;
  bool stopping = false;
  bool exited = false;
  bool store_broken = false;
  std::chrono::milliseconds period;
  int64_t beats = 0;  // this rank's liveness counter (fsdp/hb/alive/<rank>), once per period
  // A snapshot request: keys to read; the answer maps each key to its value ("" = not set).
  int64_t asked = 0, answered = 0;
  std::vector<std::string> ask_keys;
  std::map<std::string, std::optional<std::string>> answer;
  std::string answer_error;  // the store failed (not: did not answer)

  void loop();
};

void Monitor::State::loop() {
  std::unique_lock<std::mutex> lock(mutex);
  while (!stopping) {
    // What to publish, decided under the lock; the store calls run without it.
    std::vector<std::pair<std::string, int64_t>> out;
    for (auto& e : groups) {
      int64_t v = e.issued->load(std::memory_order_relaxed);
      if (v != e.published) {
        out.emplace_back(key_for(e.uid, world_rank), v);
        e.published = v;
      }
    }
    // Liveness, whatever the collectives do: a rank whose counter stops has lost its host, its
    // network or its process (Note [Collective timeouts]).
    out.emplace_back(key_for("alive", world_rank), ++beats);
    const int64_t request = asked;
    std::vector<std::string> keys;
    if (request != answered) keys = ask_keys;
    const bool broken = store_broken;
    lock.unlock();
    bool failed = false;
    std::string why;
    std::map<std::string, std::optional<std::string>> values;
    if (!broken) {
      try {
        for (const auto& [key, v] : out) store->set(key, encode(v));
        for (const auto& key : keys) {
          if (store->check({key})) {
            auto raw = store->get(key);
            values[key] = std::string(raw.begin(), raw.end());
          } else {
            values[key] = std::nullopt;
          }
        }
      } catch (const c10::Error& e) {
        // The store is gone (rank 0 exited): the job is ending. Stop publishing quietly.
        failed = true;
        why = first_line(e.what_without_backtrace());
      } catch (const std::exception& e) {
        failed = true;
        why = first_line(e.what());
      }
    }
    lock.lock();
    if (failed) store_broken = true;
    if (request != answered) {
      answered = request;
      answer = std::move(values);
      answer_error = broken || failed ? (why.empty() ? "the store on rank 0 is gone" : why) : "";
      cv.notify_all();
    }
    cv.wait_for(lock, period, [&] { return stopping || asked != answered; });
  }
  exited = true;
  cv.notify_all();
}

Monitor::Monitor(c10::intrusive_ptr<c10d::Store> store, int world_rank,
                 std::chrono::milliseconds period)
    : state_(std::make_shared<State>(std::move(store), world_rank, period)),
      initial_period_(period) {
  std::thread([state = state_] { state->loop(); }).detach();
}

Monitor::~Monitor() { stop(); }

void Monitor::stop() {
  std::unique_lock<std::mutex> lock(state_->mutex);
  state_->stopping = true;
  state_->cv.notify_all();
  // The thread finishes its current store call first; one stuck on a stopped rank 0 is left
  // behind (it holds its own reference to the state). See Note [Culprit path deadlines].
  state_->cv.wait_for(lock, std::chrono::seconds(3), [&] { return state_->exited; });
}

void Monitor::add_group(const std::string& uid, std::shared_ptr<std::atomic<int64_t>> issued) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->groups.push_back(State::Entry{uid, std::move(issued), -1});
}

void Monitor::remove_group(const std::string& uid) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  auto& g = state_->groups;
  g.erase(std::remove_if(g.begin(), g.end(), [&](const State::Entry& e) { return e.uid == uid; }),
          g.end());
}

std::chrono::milliseconds Monitor::answer_deadline(std::chrono::milliseconds timeout) {
  return std::clamp<std::chrono::milliseconds>(timeout / 4, std::chrono::seconds(1),
                                               std::chrono::seconds(3));
}

namespace {

// See Note [Culprit path deadlines]: rank 0 serves the store, so a store that does not answer
// names rank 0.
std::string store_silent(int world_rank, std::chrono::milliseconds waited) {
  std::ostringstream out;
  out << "rank 0 has not been heard from for " << std::fixed << std::setprecision(1)
      << std::chrono::duration<double>(waited).count() << " s";
  const std::string where = hosts_of_ranks({0});
  out << " (" << (where.empty() ? std::string() : where + "; ")
      << "the job's store, which rank 0 serves, did not answer rank " << world_rank
      << "): " << kSilentRanks;
  return out.str();
}

}  // namespace

std::string Monitor::describe_missing(const std::string& uid,
                                      const std::vector<int>& world_ranks, int64_t seq,
                                      std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> one_at_a_time(describe_mutex_);
  State& st = *state_;
  const int me = st.world_rank;
  const auto deadline = answer_deadline(timeout);
  bool stuck = false;  // a snapshot did not come back in time
  std::string failure;
  // The values of `keys` through the heartbeat thread, waiting at most `deadline`.
  auto snapshot = [&](const std::vector<std::string>& keys) {
    std::map<std::string, std::optional<std::string>> values;
    std::unique_lock<std::mutex> lock(st.mutex);
    if (st.asked != st.answered) {  // an earlier request never came back: the store is stuck
      stuck = true;
      return values;
    }
    const int64_t request = ++st.asked;
    st.ask_keys = keys;
    st.cv.notify_all();
    if (!st.cv.wait_for(lock, deadline, [&] { return st.answered >= request || st.exited; }) ||
        st.answered < request) {
      stuck = true;
      return values;
    }
    if (!st.answer_error.empty()) failure = st.answer_error;
    values = st.answer;
    return values;
  };
  auto cannot_tell = [&] {
    return "(cannot tell which ranks are missing: store query failed: " + failure + ")";
  };
  try {
    {
      std::lock_guard<std::mutex> lock(st.mutex);
      // Shorter heartbeats from now on, so the others' values are fresh when we read; and this
      // group's position published again with the next beat.
      auto quick = std::max<std::chrono::milliseconds>(
          std::chrono::milliseconds(100),
          std::min<std::chrono::milliseconds>(std::chrono::seconds(1), timeout / 4));
      st.period = std::min(st.period, quick);
      for (auto& e : st.groups) {
        if (e.uid == uid) e.published = -1;
      }
    }
    std::vector<std::string> alive_keys, group_keys;
    for (int r : world_ranks) {
      if (r == me) continue;
      alive_keys.push_back(key_for("alive", r));
      group_keys.push_back(key_for(uid, r));
    }
    // Liveness counters now and after the wait: a rank whose counter did not move in more than
    // its heartbeat period is not running or not reachable.
    const auto alive_before = snapshot(alive_keys);
    if (stuck && me != 0) return store_silent(me, deadline);
    if (!failure.empty()) return cannot_tell();
    // Others publish at most one (old) period after a change: wait that long once, and longer
    // than one heartbeat period so a live rank's counter moves.
    const auto wait = std::max<std::chrono::milliseconds>(
        initial_period_ + std::chrono::milliseconds(500),
        std::min<std::chrono::milliseconds>(
            std::chrono::milliseconds(1100),
            std::max<std::chrono::milliseconds>(std::chrono::milliseconds(300), timeout / 2)));
    std::this_thread::sleep_for(wait);
    std::vector<std::string> keys = alive_keys;
    keys.insert(keys.end(), group_keys.begin(), group_keys.end());
    const auto after = snapshot(keys);
    if (stuck && me != 0) return store_silent(me, deadline);
    if (!failure.empty() || stuck) {
      if (failure.empty()) failure = "this rank's own store did not answer";
      return cannot_tell();
    }
    std::vector<int> behind, ahead;
    std::map<int, std::string> details;
    for (int r : world_ranks) {
      if (r == me) continue;
      const auto& value = after.at(key_for(uid, r));
      if (!value) {
        behind.push_back(r);
        details[r] = "rank " + std::to_string(r) + " never called a collective on this group";
        continue;
      }
      int64_t v = std::stoll(*value);
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
      const auto& b = alive_before.at(key_for("alive", r));
      const auto& a = after.at(key_for("alive", r));
      const bool stopped = b && a && *a == *b;
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
  } catch (const std::exception& e) {  // a value that is not a number: another job's key?
    return std::string("(cannot tell which ranks are missing: ") + first_line(e.what()) + ")";
  }
}

}  // namespace fsdp::detail
