//===- Trace.cpp - What one pass of a task program did, over time ---------===//

#include "runtime/trace/Trace.h"

#include "base/File.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <string_view>
#include <tuple>

namespace moec::trace {

using namespace moec::format;

namespace {

/// Appends `text` to `out` as a JSON string, quotes included.
void appendJsonString(std::string &out, std::string_view text) {
  out += '"';
  for (char c : text) {
    switch (c) {
    case '"':
      out += "\\\"";
      break;
    case '\\':
      out += "\\\\";
      break;
    case '\n':
      out += "\\n";
      break;
    case '\t':
      out += "\\t";
      break;
    default:
      if (static_cast<unsigned char>(c) < 0x20)
        out += fmt::format("\\u{:04x}", static_cast<unsigned>(static_cast<unsigned char>(c)));
      else
        out += c;
    }
  }
  out += '"';
}

std::string jsonString(std::string_view text) {
  std::string out;
  appendJsonString(out, text);
  return out;
}

/// Microseconds, to the nanosecond.
std::string micros(int64_t ns) { return fmt::format("{:.3f}", double(ns) * 1e-3); }

std::string_view opNameOf(const TaskProgram &program, uint32_t task) {
  if (task >= program.tasks.size() || program.tasks[task].op >= program.ops.size())
    return "?";
  return program.name(program.ops[program.tasks[task].op].name);
}

/// Half a slice's length, at most 500 ns: how far inside a slice a flow
/// end is placed, so that it binds to that slice and not to a neighbour
/// that touches it.
int64_t inset(const TaskSpan &span) {
  return std::min<int64_t>((span.endNs - span.startNs) / 2, 500);
}

} // namespace

void Trace::shift(int64_t ns) {
  for (TaskSpan &span : tasks) {
    span.startNs += ns;
    span.endNs += ns;
  }
  for (WaitSpan &span : waits) {
    span.beginNs += ns;
    span.endNs += ns;
  }
  for (PhaseSpan &span : phases) {
    span.beginNs += ns;
    span.endNs += ns;
  }
}

void Trace::append(const Trace &other) {
  tasks.insert(tasks.end(), other.tasks.begin(), other.tasks.end());
  waits.insert(waits.end(), other.waits.begin(), other.waits.end());
  phases.insert(phases.end(), other.phases.begin(), other.phases.end());
}

void Trace::sort() {
  std::sort(tasks.begin(), tasks.end(), [](const TaskSpan &a, const TaskSpan &b) {
    return std::tie(a.startNs, a.rank, a.queue) < std::tie(b.startNs, b.rank, b.queue);
  });
  std::sort(waits.begin(), waits.end(), [](const WaitSpan &a, const WaitSpan &b) {
    return std::tie(a.beginNs, a.rank, a.queue) < std::tie(b.beginNs, b.rank, b.queue);
  });
}

namespace {

/// Fixed-size records of packTrace(): counts, then the spans field by field
/// (phase names as a length and the characters).
template <typename T> void pack(std::vector<char> &out, const T &value) {
  const char *bytes = reinterpret_cast<const char *>(&value);
  out.insert(out.end(), bytes, bytes + sizeof value);
}

class Unpacker {
public:
  Unpacker(const char *bytes, size_t size) : at(bytes), end(bytes + size) {}
  template <typename T> bool take(T *value) {
    if (size_t(end - at) < sizeof(T))
      return false;
    std::memcpy(value, at, sizeof(T));
    at += sizeof(T);
    return true;
  }
  bool take(std::string *text, uint64_t size) {
    if (uint64_t(end - at) < size)
      return false;
    text->assign(at, size);
    at += size;
    return true;
  }

private:
  const char *at;
  const char *end;
};

} // namespace

std::vector<char> packTrace(const Trace &trace) {
  std::vector<char> out;
  pack(out, uint64_t(trace.tasks.size()));
  pack(out, uint64_t(trace.waits.size()));
  pack(out, uint64_t(trace.phases.size()));
  for (const TaskSpan &s : trace.tasks)
    pack(out, s);
  for (const WaitSpan &s : trace.waits)
    pack(out, s);
  for (const PhaseSpan &s : trace.phases) {
    pack(out, s.rank);
    pack(out, s.beginNs);
    pack(out, s.endNs);
    pack(out, uint64_t(s.name.size()));
    out.insert(out.end(), s.name.begin(), s.name.end());
  }
  return out;
}

Status unpackTrace(const char *bytes, size_t size, Trace *out) {
  Unpacker in(bytes, size);
  uint64_t tasks = 0, waits = 0, phases = 0;
  const Status bad = Status::error("a packed trace that is cut short or too long");
  if (!in.take(&tasks) || !in.take(&waits) || !in.take(&phases) ||
      tasks > size / sizeof(TaskSpan) || waits > size / sizeof(WaitSpan) || phases > size)
    return bad;
  for (uint64_t i = 0; i < tasks; ++i) {
    TaskSpan s;
    if (!in.take(&s))
      return bad;
    out->tasks.push_back(s);
  }
  for (uint64_t i = 0; i < waits; ++i) {
    WaitSpan s;
    if (!in.take(&s))
      return bad;
    out->waits.push_back(s);
  }
  for (uint64_t i = 0; i < phases; ++i) {
    PhaseSpan s;
    uint64_t length = 0;
    if (!in.take(&s.rank) || !in.take(&s.beginNs) || !in.take(&s.endNs) || !in.take(&length) ||
        !in.take(&s.name, length))
      return bad;
    out->phases.push_back(std::move(s));
  }
  return Status::success();
}

std::string coreName(const TaskProgram &program, uint32_t queue) {
  if (queue >= program.queues.size())
    return fmt::format("queue {}", queue);
  const QueueRecord &record = program.queues[queue];
  return fmt::format("{} core {}", coreKindName(record.coreKind), record.coreIndex);
}

std::string chromeTraceJson(const TaskProgram &program, const Trace &trace,
                            const std::string &binary) {
  std::string out;
  out.reserve(trace.tasks.size() * 260 + trace.waits.size() * 360 + 4096);
  out += "{\"displayTimeUnit\":\"ns\",\"metadata\":{\"source\":";
  appendJsonString(out, trace.source);
  out += ",\"profile\":";
  appendJsonString(out, trace.profile);
  out += fmt::format(",\"pass\":\"{}\",\"binary\":", program.isBackward() ? "backward" : "forward");
  appendJsonString(out, binary);
  out += fmt::format(",\"ep_ranks\":{},\"local_experts\":{}}},\"traceEvents\":[", program.epRanks,
                     program.localExperts);
  bool first = true;
  auto next = [&] {
    out += first ? "\n" : ",\n";
    first = false;
  };
  const uint32_t queueCount = uint32_t(program.queues.size());
  const uint32_t hostTid = queueCount;
  // Name the ranks and cores that appear.
  std::vector<uint8_t> rankSeen(program.epRanks, 0), hostSeen(program.epRanks, 0);
  for (const TaskSpan &span : trace.tasks)
    if (span.rank < program.epRanks)
      rankSeen[span.rank] = 1;
  for (const PhaseSpan &span : trace.phases)
    if (span.rank < program.epRanks)
      rankSeen[span.rank] = hostSeen[span.rank] = 1;
  for (uint32_t rank = 0; rank < program.epRanks; ++rank) {
    if (!rankSeen[rank])
      continue;
    next();
    out += fmt::format("{{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":{},\"tid\":0,"
                       "\"args\":{{\"name\":\"rank {}\"}}}}",
                       rank, rank);
    next();
    out += fmt::format("{{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":{},\"tid\":0,"
                       "\"args\":{{\"sort_index\":{}}}}}",
                       rank, rank);
    for (uint32_t q = 0; q <= queueCount; ++q) {
      if (q == hostTid && !hostSeen[rank])
        continue;
      next();
      out += fmt::format("{{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":{},\"tid\":{},"
                         "\"args\":{{\"name\":\"{}\"}}}}",
                         rank, q, q == hostTid ? std::string("host") : coreName(program, q));
      next();
      out += fmt::format("{{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":{},\"tid\":{},"
                         "\"args\":{{\"sort_index\":{}}}}}",
                         rank, q, q == hostTid ? -1 : int64_t(q));
    }
  }

  for (const PhaseSpan &span : trace.phases) {
    next();
    out += "{\"name\":";
    appendJsonString(out, span.name);
    out += fmt::format(",\"cat\":\"phase\",\"ph\":\"X\",\"pid\":{},\"tid\":{},\"ts\":{},"
                       "\"dur\":{}}}",
                       span.rank, hostTid, micros(span.beginNs), micros(span.endNs - span.beginNs));
  }

  std::map<std::pair<uint32_t, uint32_t>, size_t> spanOf; // (rank, task) -> index in tasks
  for (size_t i = 0; i < trace.tasks.size(); ++i) {
    const TaskSpan &span = trace.tasks[i];
    spanOf[{span.rank, span.task}] = i;
    next();
    out += "{\"name\":";
    appendJsonString(out, opNameOf(program, span.task));
    const bool known = span.task < program.tasks.size() &&
                       program.tasks[span.task].op < program.ops.size() &&
                       span.rank < program.epRanks;
    const char *category = known ? opKindName(program.ops[program.tasks[span.task].op].kind) : "?";
    out += fmt::format(",\"cat\":\"{}\",\"ph\":\"X\",\"pid\":{},\"tid\":{},\"ts\":{},\"dur\":{},"
                       "\"args\":{{\"task\":{},\"op\":{},\"rank\":{}",
                       category, span.rank, span.queue, micros(span.startNs),
                       micros(span.endNs - span.startNs), span.task,
                       known ? program.tasks[span.task].op : kNone, span.rank);
    if (known) {
      RankTile tile = rankTile(program, span.task, span.rank);
      out += fmt::format(",\"expert\":{},\"peer\":{},\"row_tile\":{},\"col_tile\":{},"
                         "\"rows\":[{},{}],\"cols\":[{},{}]",
                         tile.expert, tile.peerRank, tile.coord.rowTile, tile.coord.colTile,
                         tile.coord.rowBegin, tile.coord.rowEnd, tile.coord.colBegin,
                         tile.coord.colEnd);
    }
    out += fmt::format(",\"worker\":{}", span.worker);
    if (span.offCoreNs >= 0)
      out += fmt::format(",\"off_core_us\":{}", micros(span.offCoreNs));
    out += "}}";
  }

  uint64_t flowId = 0;
  for (const WaitSpan &wait : trace.waits) {
    std::string_view eventName =
        wait.event < program.events.size() ? program.name(program.events[wait.event].name) : "?";
    next();
    out += "{\"name\":" + jsonString(fmt::format("wait {}", eventName));
    out += fmt::format(",\"cat\":\"wait\",\"ph\":\"X\",\"pid\":{},\"tid\":{},\"ts\":{},\"dur\":{},"
                       "\"args\":{{\"event\":{},\"event_name\":{},\"task\":{},\"signal_rank\":{},"
                       "\"signal_task\":{}}}}}",
                       wait.rank, wait.queue, micros(wait.beginNs),
                       micros(wait.endNs - wait.beginNs), wait.event, jsonString(eventName),
                       wait.task, wait.signalRank == kUnknown ? -1 : int64_t(wait.signalRank),
                       wait.signalTask == kUnknown ? -1 : int64_t(wait.signalTask));
    if (wait.signalRank == kUnknown || wait.signalTask == kUnknown)
      continue;
    auto from = spanOf.find({wait.signalRank, wait.signalTask});
    auto to = spanOf.find({wait.rank, wait.task});
    if (from == spanOf.end() || to == spanOf.end())
      continue;
    const TaskSpan &source = trace.tasks[from->second], &sink = trace.tasks[to->second];
    int64_t sent = std::clamp(wait.endNs, source.startNs + inset(source), source.endNs - inset(source));
    ++flowId;
    next();
    out += fmt::format("{{\"name\":\"signal\",\"cat\":\"signal\",\"ph\":\"s\",\"id\":{},"
                       "\"pid\":{},\"tid\":{},\"ts\":{}}}",
                       flowId, source.rank, source.queue, micros(sent));
    next();
    out += fmt::format("{{\"name\":\"signal\",\"cat\":\"signal\",\"ph\":\"f\",\"bp\":\"e\","
                       "\"id\":{},\"pid\":{},\"tid\":{},\"ts\":{}}}",
                       flowId, sink.rank, sink.queue, micros(sink.startNs + inset(sink)));
  }
  out += "\n]}\n";
  return out;
}

Status writeChromeTrace(const TaskProgram &program, const Trace &trace, const std::string &path,
                        const std::string &binary) {
  const std::string text = chromeTraceJson(program, trace, binary);
  return writeFileAtomically(path, {{text.data(), text.size()}});
}

} // namespace moec::trace
