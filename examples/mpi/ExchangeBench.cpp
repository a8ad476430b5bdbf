//===- ExchangeBench.cpp - Dispatch + combine against MPI_Alltoallv ---------===//
//
//   mpirun -np R bazel-bin/examples/mpi/exchange_bench DISPATCH COMBINE [S [REPEAT]]
//
// The same rows moved two ways, in one run, on the same routing and data:
//
//   moec   rt::Exchange over the MPI fabric: route() (the count exchange
//          and the layout), dispatch() (each rank's rows to the ranks of
//          their experts) and combine() (the rows back, each (t, k) row
//          times its top-k weight, summed per token), one worker thread;
//   MPI    what a user writes with MPI alone: the rows sorted by
//          destination rank (expert-major, a counting sort), MPI_Alltoall of the counts,
//          MPI_Alltoallv of the rows, MPI_Alltoallv back, and the same
//          weighted sum per token.
//
// The experts do nothing (the rows go back as they came), so y is the same
// both ways (checked). Prints the best time of each over REPEAT rounds, on
// rank 0. x, the routing and the weights come from a fixed seed.
//
//===----------------------------------------------------------------------===//

#include "base/Time.h"
#include "runtime/api/Runtime.h"
#include "runtime/comm/Mpi.h"

#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

using namespace moec;

namespace {

int fail(const Status &status) {
  std::fprintf(stderr, "exchange_bench: %s\n", status.message().c_str());
  comm::abortMpi(1);
}

/// One rank's tokens, routing and rows.
struct Data {
  int64_t S = 0, K = 0, H = 0, E = 0;
  std::vector<float> x;       ///< [S, H]
  std::vector<int64_t> ids;   ///< [S, K], K distinct experts per token
  std::vector<float> weights; ///< [S, K]
};

Data makeData(uint32_t rank, int64_t S, int64_t K, int64_t H, int64_t E) {
  Data d{S, K, H, E, std::vector<float>(size_t(S * H)), std::vector<int64_t>(size_t(S * K)),
         std::vector<float>(size_t(S * K))};
  std::mt19937_64 random(1234 + rank);
  std::uniform_real_distribution<float> value(-1, 1);
  for (float &v : d.x)
    v = value(random);
  std::vector<int64_t> experts(static_cast<size_t>(E));
  std::iota(experts.begin(), experts.end(), 0);
  for (int64_t t = 0; t < S; ++t) {
    std::shuffle(experts.begin(), experts.end(), random);
    for (int64_t k = 0; k < K; ++k) {
      d.ids[size_t(t * K + k)] = experts[size_t(k)];
      d.weights[size_t(t * K + k)] = 0.25f + 0.5f * float(k + 1) / float(K);
    }
  }
  return d;
}

/// The MPI-only version: returns y [S, H].
std::vector<float> alltoallv(const Data &d, uint32_t ranks, MPI_Comm comm) {
  const int64_t S = d.S, K = d.K, H = d.H, L = d.E / ranks;
  // Rows sorted by destination rank, expert-major: a counting sort.
  std::vector<int64_t> start(static_cast<size_t>(d.E + 1), 0);
  for (int64_t id : d.ids)
    ++start[size_t(id + 1)];
  std::partial_sum(start.begin(), start.end(), start.begin());
  std::vector<int> sendRows(ranks, 0), recvRows(ranks, 0);
  for (int64_t e = 0; e < d.E; ++e)
    sendRows[size_t(e / L)] += int(start[size_t(e + 1)] - start[size_t(e)]);
  std::vector<int64_t> order(size_t(S * K));
  for (int64_t i = 0; i < S * K; ++i)
    order[size_t(start[size_t(d.ids[size_t(i)])]++)] = i;
  MPI_Alltoall(sendRows.data(), 1, MPI_INT, recvRows.data(), 1, MPI_INT, comm);
  std::vector<float> send(size_t(S * K * H));
  for (size_t i = 0; i < order.size(); ++i)
    std::memcpy(&send[i * size_t(H)], &d.x[size_t(order[i] / K * H)], size_t(H) * sizeof(float));
  std::vector<int> sendCounts(ranks), sendOffsets(ranks), recvCounts(ranks), recvOffsets(ranks);
  int sent = 0, received = 0;
  for (uint32_t p = 0; p < ranks; ++p) {
    sendCounts[p] = sendRows[p] * int(H);
    recvCounts[p] = recvRows[p] * int(H);
    sendOffsets[p] = sent;
    recvOffsets[p] = received;
    sent += sendCounts[p];
    received += recvCounts[p];
  }
  std::vector<float> expertRows(static_cast<size_t>(received));
  MPI_Alltoallv(send.data(), sendCounts.data(), sendOffsets.data(), MPI_FLOAT, expertRows.data(),
                recvCounts.data(), recvOffsets.data(), MPI_FLOAT, comm);
  // The experts: nothing; the rows go back where they came from.
  std::vector<float> back(send.size());
  MPI_Alltoallv(expertRows.data(), recvCounts.data(), recvOffsets.data(), MPI_FLOAT, back.data(),
                sendCounts.data(), sendOffsets.data(), MPI_FLOAT, comm);
  std::vector<int64_t> position(order.size());
  for (size_t i = 0; i < order.size(); ++i)
    position[size_t(order[i])] = int64_t(i);
  std::vector<float> y(size_t(S * H), 0.0f);
  for (int64_t t = 0; t < S; ++t) {
    float *out = &y[size_t(t * H)];
    for (int64_t k = 0; k < K; ++k) {
      const float w = d.weights[size_t(t * K + k)];
      const float *row = &back[size_t(position[size_t(t * K + k)] * H)];
      for (int64_t h = 0; h < H; ++h)
        out[h] += w * row[h];
    }
  }
  return y;
}

} // namespace

int main(int argc, char **argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: mpirun -np R exchange_bench DISPATCH COMBINE [S [REPEAT]]\n");
    return 2;
  }
  const int64_t S = argc > 3 ? std::atoll(argv[3]) : 512;
  const int repeat = argc > 4 ? std::atoi(argv[4]) : 10;
  std::shared_ptr<comm::Fabric> fabric;
  if (Status s = comm::createMpiFabric(&fabric); !s)
    return fail(s);
  std::shared_ptr<const rt::Program> dispatch, combine;
  if (Status s = rt::Program::load(argv[1], &dispatch); !s)
    return fail(s);
  if (Status s = rt::Program::load(argv[2], &combine); !s)
    return fail(s);
  rt::ContextOptions options;
  options.workers = 1;
  options.fabric = fabric;
  std::unique_ptr<rt::Exchange> exchange;
  if (Status s = rt::Exchange::create(dispatch, combine, options, &exchange); !s)
    return fail(s);
  const uint32_t R = exchange->ranks(), me = exchange->firstLocalRank();
  const LayerShape &shape = exchange->shape();
  if (shape.activations != format::DType::F32)
    return fail(Status::error("the binaries must be fp32"));
  const int64_t H = shape.hidden, E = int64_t(R) * shape.localExperts, K = shape.topK;
  Data d = makeData(me, S, K, H, E);
  std::vector<float> y(size_t(S * H));
  std::vector<float> expertX;
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);

  double bestMoec = 1e30, bestMpi = 1e30;
  std::vector<float> yMpi;
  for (int round = 0; round < repeat; ++round) {
    MPI_Barrier(comm);
    Clock::time_point t0 = Clock::now();
    if (Status s = exchange->setRouting(me, rt::makeTensor(d.ids.data(), format::DType::I64, {S, K}),
                                        rt::makeTensor(d.weights.data(), format::DType::F32, {S, K}));
        !s)
      return fail(s);
    if (Status s = exchange->route(); !s)
      return fail(s);
    const int64_t rows = exchange->receivedRows(me);
    expertX.resize(size_t(std::max<int64_t>(rows, 1) * H));
    const rt::Tensor xs = rt::makeTensor(d.x.data(), format::DType::F32, {S, H});
    const rt::Tensor ex = rt::makeTensor(expertX.data(), format::DType::F32, {rows, H});
    const rt::Tensor ys = rt::makeTensor(y.data(), format::DType::F32, {S, H});
    if (Status s = exchange->dispatch({xs}, {ex}, false); !s)
      return fail(s);
    if (Status s = exchange->combine({ex}, {ys}, true); !s)
      return fail(s);
    double mine = secondsSince(t0), slowest = 0;
    MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, comm);
    bestMoec = std::min(bestMoec, slowest);

    MPI_Barrier(comm);
    t0 = Clock::now();
    yMpi = alltoallv(d, R, comm);
    mine = secondsSince(t0);
    MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, comm);
    bestMpi = std::min(bestMpi, slowest);
  }
  double diff = 0;
  for (size_t i = 0; i < y.size(); ++i)
    diff = std::max(diff, double(std::abs(y[i] - yMpi[i])));
  double worst = 0;
  MPI_Allreduce(&diff, &worst, 1, MPI_DOUBLE, MPI_MAX, comm);
  if (me == 0) {
    const double bytes = 2.0 * double(S * K * H) * sizeof(float);
    std::printf("dispatch + combine, %u ranks, S %lld, top-%lld, H %lld, fp32, best of %d "
                "(the slowest rank's time):\n",
                R, (long long)S, (long long)K, (long long)H, repeat);
    std::printf("  moec (rt::Exchange, 1 worker)   %8.3f ms\n", bestMoec * 1e3);
    std::printf("  MPI_Alltoallv (sort + 2 moves)  %8.3f ms\n", bestMpi * 1e3);
    std::printf("  moec / MPI_Alltoallv time %.2f; rows moved per rank %.1f MiB; y differs by "
                "at most %.3g\n",
                bestMoec / bestMpi, bytes / (1 << 20), worst);
  }
  MPI_Comm_free(&comm);
  const bool same = worst <= 1e-5;
  exchange.reset();
  options.fabric.reset();
  fabric.reset();
  comm::finalizeMpi();
  if (!same) {
    if (me == 0)
      std::fprintf(stderr, "exchange_bench: y differs between the two ways\n");
    return 1;
  }
  return 0;
}
