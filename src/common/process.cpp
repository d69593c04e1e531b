// See src/common/process.h.
#include "common/process.h"

#include <cerrno>
#include <csignal>
#include <ctime>
#include <fstream>
#include <sstream>

#include <unistd.h>

namespace fsdp::detail {

namespace {

std::string first_line_of_file(const std::string& file) {
  std::ifstream in(file);
  std::string line;
  std::getline(in, line);
  return line;
}

// Field 22 of /proc/<pid>/stat (starttime), 0 when the process does not exist.
int64_t start_ticks(int64_t pid) {
  const std::string stat = first_line_of_file("/proc/" + std::to_string(pid) + "/stat");
  const auto close = stat.rfind(')');  // the command name may hold spaces and ')'
  if (close == std::string::npos) return 0;
  std::istringstream fields(stat.substr(close + 1));
  std::string f;
  for (int i = 3; i <= 22 && fields >> f; ++i) {
    if (i == 22) return std::strtoll(f.c_str(), nullptr, 10);
  }
  return 0;
}

}  // namespace

std::string host_name() {
  char buf[256] = {0};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "unknown";
  return buf;
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

ProcessId this_process() {
  ProcessId p;
  p.host = host_name();
  p.boot = first_line_of_file("/proc/sys/kernel/random/boot_id");
  p.pid = ::getpid();
  p.start = start_ticks(p.pid);
  return p;
}

bool ended_or_this(const ProcessId& p) {
  const ProcessId me = this_process();
  if (p.host != me.host || p.boot != me.boot || p.boot.empty()) return false;
  if (p.pid == me.pid && p.start == me.start) return true;
  if (p.pid <= 0) return false;
  if (::kill(static_cast<pid_t>(p.pid), 0) != 0 && errno == ESRCH) return true;
  const int64_t start = start_ticks(p.pid);
  return start != 0 && start != p.start;  // the pid now names another process
}

}  // namespace fsdp::detail
