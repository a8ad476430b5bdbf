//===- Progress.cpp - What a long command is doing, on stderr -------------===//

#include "tools/moec/Progress.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>

#include <unistd.h>

namespace moec::cli {

namespace {

/// A live line is drawn only once a phase has run this long, so quick
/// commands print nothing on a terminal.
constexpr double kLiveAfterSeconds = 0.5;
/// Not on a terminal, a running phase prints a line this often.
constexpr double kLogEverySeconds = 5;

std::string seconds(double s) {
  if (s < 1)
    return fmt::format("{:.0f} ms", s * 1e3);
  if (s < 60)
    return fmt::format("{:.1f} s", s);
  const long total = long(s + 0.5);
  return total < 3600 ? fmt::format("{}m{:02}s", total / 60, total % 60)
                      : fmt::format("{}h{:02}m", total / 3600, total % 3600 / 60);
}

std::string count(double x) {
  return x == std::floor(x) && x < 1e15 ? fmt::format("{}", (long long)x) : fmt::format("{:.1f}", x);
}

/// The Progress that exists now (a command makes one at a time).
std::atomic<Progress *> current{nullptr};

} // namespace

void Progress::abandonCurrent() {
  if (Progress *p = current.load())
    p->abandon();
}

void Progress::abandon() {
  if (!enabled())
    return;
  {
    std::lock_guard<std::mutex> lock(mutex);
    active = false;
    poll = nullptr;
  }
  clear();
}

Progress::Mode progressMode(bool on, bool off) {
  return off ? Progress::Mode::Never : on ? Progress::Mode::Always : Progress::Mode::Auto;
}

Progress::Progress(std::string command, Mode mode, std::FILE *out)
    : command(std::move(command)), mode(mode), out(out) {
  const bool terminal = isatty(fileno(out)) == 1;
  if (this->mode == Mode::Auto && !terminal)
    this->mode = Mode::Never;
  live = terminal && this->mode != Mode::Never;
  if (enabled())
    ticker = std::thread([this] { tick(); });
  current.store(this);
}

Progress::~Progress() {
  Progress *self = this;
  current.compare_exchange_strong(self, nullptr);
  if (ticker.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stop = true;
    }
    wake.notify_all();
    ticker.join();
  }
  clear();
}

void Progress::begin(const std::string &name, double total, std::function<double()> poller) {
  end();
  if (!enabled())
    return;
  std::lock_guard<std::mutex> lock(mutex);
  active = true;
  drawn = false;
  phase = name;
  steps = total;
  done = 0;
  poll = std::move(poller);
  started = lastLine = Clock::now();
}

void Progress::update(double value) {
  if (!enabled())
    return;
  std::lock_guard<std::mutex> lock(mutex);
  done = std::max(0.0, value);
}

void Progress::end() {
  if (!enabled())
    return;
  std::lock_guard<std::mutex> lock(mutex);
  if (!active)
    return;
  if (steps > 0)
    done = steps;
  const double spent = std::chrono::duration<double>(Clock::now() - started).count();
  // On a terminal a phase too quick to have been drawn leaves no line.
  if (!live || drawn) {
    if (live)
      std::fputs("\r\033[K", out);
    std::fputs(fmt::format("{}: {} done in {}\n", command, phase, seconds(spent)).c_str(), out);
    std::fflush(out);
  }
  active = false;
  drawn = false;
  poll = nullptr;
}

void Progress::clear() {
  if (!live)
    return;
  std::lock_guard<std::mutex> lock(mutex);
  if (drawn) {
    std::fputs("\r\033[K", out);
    std::fflush(out);
    drawn = false;
  }
}

std::string Progress::line(double spent) const {
  std::string text = fmt::format("{}: {}", command, phase);
  if (steps > 0) {
    const double share = std::min(1.0, done / steps);
    constexpr int kWidth = 20;
    const int filled = int(share * kWidth);
    text += fmt::format("  [{}{}]  ", std::string(size_t(filled), '#'),
                        std::string(size_t(kWidth - filled), '.'));
    text += steps == 1 ? fmt::format("{:.0f}%", 100 * share)
                       : fmt::format("{}/{}", count(done), count(steps));
  }
  text += "  " + seconds(spent);
  if (steps > 0 && done > 0 && done < steps)
    text += "  ETA " + seconds(spent * (steps - done) / done);
  return text;
}

void Progress::tick() {
  std::unique_lock<std::mutex> lock(mutex);
  while (!stop) {
    wake.wait_for(lock, std::chrono::milliseconds(live ? 200 : 500));
    if (stop || !active)
      continue;
    if (poll)
      done = std::max(done, poll());
    const Clock::time_point now = Clock::now();
    const double spent = std::chrono::duration<double>(now - started).count();
    if (live) {
      if (spent < kLiveAfterSeconds)
        continue;
      std::fputs(("\r\033[K" + line(spent)).c_str(), out);
      drawn = true;
    } else {
      if (std::chrono::duration<double>(now - lastLine).count() < kLogEverySeconds)
        continue;
      lastLine = now;
      std::fputs((line(spent) + "\n").c_str(), out);
    }
    std::fflush(out);
  }
}

} // namespace moec::cli
