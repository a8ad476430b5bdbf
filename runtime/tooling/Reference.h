//===- Reference.h - Reference implementation of the MoE-FFN layer -*- C++ -*-===//
//
// The whole layer, forward and backward, for an EP group of R ranks, written
// as plain loops that follow the math line by line. It is the oracle the
// kernels and the runtime are tested against, so it shares no code with the
// kernels and favours being obviously right over being fast. The math:
//
//   dispatch   row (t, k) of rank r goes to expert e = topk_ids_r[t, k]
//   expert e   Y = X w1[e],  A = silu(Y[:, :I]) * Y[:, I:],  Z = A w2[e]
//   combine    y_r[t] = sum_k topk_weights_r[t, k] * Z row of (r, t, k)
//   backward   dtopk_weights_r[t, k] = <dy_r[t], Z row>,
//              dZ row = topk_weights_r[t, k] * dy_r[t],
//              dA = dZ w2[e]^T,  dw2[e] = A^T dZ,  dY = swiglu_grad(Y, dA),
//              dX = dY w1[e]^T,  dw1[e] = X^T dY,  dx_r[t] = sum_k dX row
//
// It computes in the scalar type T (float or double) over inputs of that
// type; a bf16 run rounds its inputs to bf16 first and compares with a
// tolerance. Shapes (all row-major):
//
//   per rank r:   x [S, H], topkIds [S, K], topkWeights [S, K], dy [S, H]
//   weights:      w1 [E, H, 2I] (columns 0..I-1 gate, I..2I-1 up), w2 [E, I, H]
//                 (all E experts; rank r owns experts r*L .. r*L+L-1)
//
// Dispatch order: expert e receives the rows (r, t, k) with topkIds_r[t][k] =
// e, ordered by source rank r, then token t, then k. The per-expert tensors
// of Forward (X, Y, A, Z) are in that order.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_CPU_REFERENCE_H
#define MOEC_RUNTIME_CPU_REFERENCE_H

#include "format/LayerShape.h"
#include "base/Status.h"

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

namespace moec::reference {

/// The sizes of the layer (format/LayerShape.h: R, L, H, I, S, K; the
/// reference reads no capacity or dtype of it).
using LayerShape = moec::LayerShape;

/// Checks the sizes: R >= 1, L >= 1, 1 <= K <= E, and H, I, S >= 0.
Status validateShape(const LayerShape &shape);

/// One rank's inputs.
template <typename T> struct RankInputs {
  std::vector<T> x;                ///< [S, H]
  std::vector<int64_t> topkIds;    ///< [S, K], distinct experts per token
  std::vector<T> topkWeights;      ///< [S, K]
};

/// The expert weights of the whole group.
template <typename T> struct Weights {
  std::vector<T> w1; ///< [E, H, 2I]
  std::vector<T> w2; ///< [E, I, H]
};

/// Where a dispatched row comes from: token `token` of rank `rank`, top-k
/// position `k`.
struct RowSource {
  int64_t rank = 0;
  int64_t token = 0;
  int64_t k = 0;
};

/// What one expert computes in the forward pass, in dispatch order.
template <typename T> struct ExpertActivations {
  std::vector<RowSource> rows; ///< n rows
  std::vector<T> x;            ///< X [n, H], the dispatched rows
  std::vector<T> y;            ///< Y [n, 2I] = X w1[e]
  std::vector<T> a;            ///< A [n, I] = silu(Y[:, :I]) * Y[:, I:]
  std::vector<T> z;            ///< Z [n, H] = A w2[e]
};

/// The forward pass's results: the outputs and what backward needs.
template <typename T> struct Forward {
  std::vector<std::vector<T>> y;               ///< per rank: y [S, H]
  std::vector<ExpertActivations<T>> experts;   ///< per expert (global index)
};

/// The backward pass's results.
template <typename T> struct Backward {
  std::vector<std::vector<T>> dx;           ///< per rank: dx [S, H]
  std::vector<std::vector<T>> dtopkWeights; ///< per rank: [S, K]
  std::vector<T> dw1;                       ///< [E, H, 2I]
  std::vector<T> dw2;                       ///< [E, I, H]
};

/// Checks the sizes of `inputs` (one per rank) and `weights` against `shape`,
/// and that every top-k id is an expert and distinct within its token.
template <typename T>
Status validateInputs(const LayerShape &shape, const std::vector<RankInputs<T>> &inputs,
                      const Weights<T> &weights);

/// Told the share of a pass done (0..1) after each expert; may be empty.
using Progress = std::function<void(double done)>;

/// Runs the forward pass: dispatch, per expert Y = X w1[e], A = swiglu(Y),
/// Z = A w2[e], and combine y[t] = sum_k w[t, k] * Z row of (t, k).
template <typename T>
Status forward(const LayerShape &shape, const std::vector<RankInputs<T>> &inputs,
               const Weights<T> &weights, Forward<T> *out, const Progress &progress = {});

/// Runs the backward pass from the upstream gradient `dy` (one [S, H] per
/// rank) and the forward results `fwd`: dtopk_weights, dZ = w dy dispatched,
/// dA = dZ w2^T, dw2 = A^T dZ, dY = swiglu_grad(Y, dA), dX = dY w1^T,
/// dw1 = X^T dY, and dx[t] = sum_k dX row of (t, k).
template <typename T>
Status backward(const LayerShape &shape, const std::vector<RankInputs<T>> &inputs,
                const Weights<T> &weights, const Forward<T> &fwd,
                const std::vector<std::vector<T>> &dy, Backward<T> *out,
                const Progress &progress = {});

/// The whole group's inputs as flat row-major arrays, not copied: x, topkIds,
/// topkWeights and dy are rank-major ([R, S, ...]); dy is null for a
/// forward-only check.
template <typename T> struct InputView {
  const T *x = nullptr;             ///< [R, S, H]
  const int64_t *topkIds = nullptr; ///< [R, S, K]
  const T *topkWeights = nullptr;   ///< [R, S, K]
  const T *w1 = nullptr;            ///< [E, H, 2I]
  const T *w2 = nullptr;            ///< [E, I, H]
  const T *dy = nullptr;            ///< [R, S, H] or null
  /// LoRA adapters, null on a projection without one: projection p (0: w1,
  /// K = H, N = 2I; 1: w2, K = I, N = H) computes with W + loraScale A B,
  /// A [E, K, r], B [E, r, N], r = loraRank.
  const T *loraA[2] = {nullptr, nullptr};
  const T *loraB[2] = {nullptr, nullptr};
  int64_t loraRank = 0;
  double loraScale = 0;
};

/// What a sampled check computes: whole outputs of some tokens, and the
/// weight gradients of some intermediate units. Unit i of expert e is row i
/// of w2[e] and columns i (gate) and I + i (up) of w1[e]; its gradients need
/// only the rows routed to e, at O(H) each, not the whole layer. With LoRA
/// adapters a unit is also columns i and I + i of w1's B and row i of w2's
/// A (O(H r) a row); w1's A and w2's B need every unit of each row, so no
/// sample covers them.
struct Sample {
  std::vector<int64_t> tokens;                    ///< global token r * S + t
  std::vector<std::pair<int64_t, int64_t>> units; ///< (expert, unit i in 0..I-1)
};

/// The reference values of a Sample, in the order of its lists.
template <typename T> struct SampleOutputs {
  std::vector<T> y;     ///< per token: y [H]
  std::vector<T> dx;    ///< per token: dx [H] (with dy)
  std::vector<T> dtopk; ///< per token: dtopk_weights [K] (with dy)
  std::vector<T> dw1;   ///< per unit [H, 2]: dw1[e][h][i], dw1[e][h][I + i] (with dy)
  std::vector<T> dw2;   ///< per unit: dw2[e][i][0..H-1] (with dy)
  std::vector<T> dloraB1; ///< per unit [r, 2]: dlora_b1[e][q][i], [e][q][I + i] (w1's adapter)
  std::vector<T> dloraA2; ///< per unit [r]: dlora_a2[e][i][0..r-1] (w2's adapter)
};

/// Computes the sample's outputs from the inputs, in double, token by
/// token and unit by unit: the same math as forward() and backward(), in
/// memory that grows with the sample, not the layer. Checks the sample's
/// indices and the top-k ids of every token.
template <typename T>
Status sampled(const LayerShape &shape, const InputView<T> &inputs, const Sample &sample,
               SampleOutputs<double> *out, const Progress &progress = {});

/// silu(x) = x * sigmoid(x).
template <typename T> T silu(T x);

/// silu'(x) = sigmoid(x) * (1 + x * (1 - sigmoid(x))).
template <typename T> T siluGrad(T x);

/// C [m, n] = A [m, k] B [k, n], row-major and dense, by the textbook triple
/// loop (accumulating in T). The kernel tests and benchmarks use it.
template <typename T>
void matmul(int64_t m, int64_t n, int64_t k, const T *a, const T *b, T *c);

} // namespace moec::reference

#endif // MOEC_RUNTIME_CPU_REFERENCE_H
