//===- Progress.h - What a long command is doing, on stderr -----*- C++ -*-===//
//
// Long runs of `moec run`, `bench` and `compile` say what they are doing:
// a command goes through named phases, each with a count of steps when it
// has one. On a terminal a live line shows the phase, a bar, the steps, the
// time spent and an estimate of the time left; a finished phase leaves a
// line with its time. Not on a terminal it is silent unless asked for
// (--progress), and then prints a line when a phase ends and every few
// seconds while one runs, so a log of a batch job shows where it was.
//
//   moec run: passes    [############........]  6/10  3.1 s  ETA 2.0 s
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_TOOLS_MOEC_PROGRESS_H
#define MOEC_TOOLS_MOEC_PROGRESS_H

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace moec::cli {

class Progress {
public:
  enum class Mode {
    Auto,   ///< live on a terminal, silent elsewhere
    Always, ///< also when stderr is not a terminal (plain lines)
    Never,
  };

  /// `command` prefixes every line ("moec run").
  Progress(std::string command, Mode mode, std::FILE *out = stderr);
  /// Clears the live line; a phase still running (the command failed)
  /// leaves no "done" line.
  ~Progress();
  Progress(const Progress &) = delete;
  Progress &operator=(const Progress &) = delete;

  bool enabled() const { return mode != Mode::Never; }

  /// Ends the current phase, if any, and starts `name` with `steps` steps
  /// (0: no bar, only the time spent; 1: a share of 1, shown in percent).
  /// With `poll`, the display asks it for the steps done at every redraw
  /// (from its own thread) instead of being told with update().
  void begin(const std::string &name, double steps = 0, std::function<double()> poll = {});
  /// Sets the steps done in the current phase. Thread-safe.
  void update(double done);
  /// Ends the current phase: prints its name and time.
  void end();

  /// Clears the live line before the caller prints to stdout or stderr, so
  /// the two do not mix; the next tick redraws it.
  void clear();
  /// Drops the running phase without a "done" line (see abandonCurrent).
  void abandon();

  /// Drops the running phase of the Progress that exists now, if any,
  /// without a "done" line, and clears the live line: for error paths,
  /// which need not hold it. Once it returns, no poll function is called
  /// again, so what the poll reads may go away.
  static void abandonCurrent();

private:
  using Clock = std::chrono::steady_clock;
  void tick();
  std::string line(double seconds) const;

  std::string command;
  Mode mode;
  bool live = false; // a terminal: redraw one line in place
  std::FILE *out;

  std::mutex mutex;
  std::condition_variable wake;
  std::thread ticker;
  bool stop = false;
  bool active = false;
  bool drawn = false;
  std::string phase;
  double steps = 0, done = 0;
  std::function<double()> poll;
  Clock::time_point started, lastLine;
};

/// Progress::Mode from a command's --progress / --no-progress switches.
Progress::Mode progressMode(bool on, bool off);

} // namespace moec::cli

#endif // MOEC_TOOLS_MOEC_PROGRESS_H
