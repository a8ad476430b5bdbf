//===- Reference.cpp - Reference implementation of the MoE-FFN layer ------===//
//
// Straight loops over the math of the layer. Index helpers spell out every
// row-major offset, so each line can be checked against the math in Reference.h.
//
//===----------------------------------------------------------------------===//

#include "runtime/tooling/Reference.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

namespace moec::reference {

Status validateShape(const LayerShape &shape) {
  const int64_t experts = shape.experts();
  if (shape.ranks < 1)
    return Status::error("layer: ranks must be at least 1, got " + std::to_string(shape.ranks));
  if (shape.localExperts < 1)
    return Status::error("layer: every rank needs at least one expert, got " +
                         std::to_string(shape.localExperts) + " local experts");
  if (shape.topK < 1 || shape.topK > experts)
    return Status::error("layer: top-k (" + std::to_string(shape.topK) + ") must be in 1.." +
                         std::to_string(experts));
  if (shape.hidden < 0 || shape.inter < 0 || shape.tokens < 0)
    return Status::error("layer: hidden, inter and tokens must not be negative");
  return Status::success();
}

template <typename T> T silu(T x) { return x / (T(1) + std::exp(-x)); }

template <typename T> T siluGrad(T x) {
  const T s = T(1) / (T(1) + std::exp(-x));
  return s * (T(1) + x * (T(1) - s));
}

template <typename T>
void matmul(int64_t m, int64_t n, int64_t k, const T *a, const T *b, T *c) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      T sum = 0;
      for (int64_t p = 0; p < k; ++p)
        sum += a[i * k + p] * b[p * n + j];
      c[i * n + j] = sum;
    }
}

namespace {

std::string sizeError(const std::string &what, size_t got, int64_t want) {
  return what + " has " + std::to_string(got) + " elements, expected " + std::to_string(want);
}

} // namespace

template <typename T>
Status validateInputs(const LayerShape &shape, const std::vector<RankInputs<T>> &inputs,
                      const Weights<T> &weights) {
  if (Status status = validateShape(shape); !status)
    return status;
  const int64_t R = shape.ranks, E = int64_t(shape.experts()), H = shape.hidden, I = shape.inter,
                K = shape.topK, S = shape.tokens;
  if (int64_t(inputs.size()) != R)
    return Status::error("layer: " + std::to_string(inputs.size()) + " rank inputs for " +
                         std::to_string(R) + " ranks");
  if (int64_t(weights.w1.size()) != E * H * 2 * I)
    return Status::error(sizeError("w1", weights.w1.size(), E * H * 2 * I));
  if (int64_t(weights.w2.size()) != E * I * H)
    return Status::error(sizeError("w2", weights.w2.size(), E * I * H));
  for (int64_t r = 0; r < R; ++r) {
    const RankInputs<T> &in = inputs[size_t(r)];
    const std::string rank = "rank " + std::to_string(r) + ": ";
    if (int64_t(in.x.size()) != S * H)
      return Status::error(rank + sizeError("x", in.x.size(), S * H));
    if (int64_t(in.topkIds.size()) != S * K)
      return Status::error(rank + sizeError("topk_ids", in.topkIds.size(), S * K));
    if (int64_t(in.topkWeights.size()) != S * K)
      return Status::error(rank + sizeError("topk_weights", in.topkWeights.size(), S * K));
    for (int64_t t = 0; t < S; ++t)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t id = in.topkIds[size_t(t * K + k)];
        if (id < 0 || id >= E)
          return Status::error(rank + "topk_ids[" + std::to_string(t) + "][" +
                               std::to_string(k) + "] = " + std::to_string(id) +
                               " is not an expert");
        for (int64_t j = 0; j < k; ++j)
          if (in.topkIds[size_t(t * K + j)] == id)
            return Status::error(rank + "token " + std::to_string(t) + " routes to expert " +
                                 std::to_string(id) + " twice");
      }
  }
  return Status::success();
}

template <typename T>
Status forward(const LayerShape &shape, const std::vector<RankInputs<T>> &inputs,
               const Weights<T> &weights, Forward<T> *out, const Progress &progress) {
  if (Status status = validateInputs(shape, inputs, weights); !status)
    return status;
  const int64_t R = shape.ranks, E = int64_t(shape.experts()), H = shape.hidden, I = shape.inter,
                K = shape.topK, S = shape.tokens;
  Forward<T> result;

  // Dispatch: expert e gets rows (r, t, k) in order of r, t, k.
  result.experts.resize(size_t(E));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t t = 0; t < S; ++t)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t e = inputs[size_t(r)].topkIds[size_t(t * K + k)];
        ExpertActivations<T> &ex = result.experts[size_t(e)];
        ex.rows.push_back(RowSource{r, t, k});
        for (int64_t h = 0; h < H; ++h)
          ex.x.push_back(inputs[size_t(r)].x[size_t(t * H + h)]);
      }

  // Per expert: Y = X w1[e], A = silu(gate) * up, Z = A w2[e].
  for (int64_t e = 0; e < E; ++e) {
    ExpertActivations<T> &ex = result.experts[size_t(e)];
    const int64_t n = int64_t(ex.rows.size());
    const T *w1 = weights.w1.data() + e * H * 2 * I;
    const T *w2 = weights.w2.data() + e * I * H;
    ex.y.assign(size_t(n * 2 * I), T(0));
    ex.a.assign(size_t(n * I), T(0));
    ex.z.assign(size_t(n * H), T(0));
    for (int64_t m = 0; m < n; ++m)
      for (int64_t j = 0; j < 2 * I; ++j) {
        T sum = 0;
        for (int64_t h = 0; h < H; ++h)
          sum += ex.x[size_t(m * H + h)] * w1[h * 2 * I + j];
        ex.y[size_t(m * 2 * I + j)] = sum;
      }
    for (int64_t m = 0; m < n; ++m)
      for (int64_t i = 0; i < I; ++i)
        ex.a[size_t(m * I + i)] =
            silu(ex.y[size_t(m * 2 * I + i)]) * ex.y[size_t(m * 2 * I + I + i)];
    for (int64_t m = 0; m < n; ++m)
      for (int64_t h = 0; h < H; ++h) {
        T sum = 0;
        for (int64_t i = 0; i < I; ++i)
          sum += ex.a[size_t(m * I + i)] * w2[i * H + h];
        ex.z[size_t(m * H + h)] = sum;
      }
    if (progress)
      progress(double(e + 1) / double(E));
  }

  // Combine: y_r[t] = sum_k w_r[t, k] * Z row of (r, t, k), in k order.
  result.y.assign(size_t(R), std::vector<T>(size_t(S * H), T(0)));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t t = 0; t < S; ++t)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t e = inputs[size_t(r)].topkIds[size_t(t * K + k)];
        const ExpertActivations<T> &ex = result.experts[size_t(e)];
        int64_t row = 0;
        while (!(ex.rows[size_t(row)].rank == r && ex.rows[size_t(row)].token == t &&
                 ex.rows[size_t(row)].k == k))
          ++row;
        const T w = inputs[size_t(r)].topkWeights[size_t(t * K + k)];
        for (int64_t h = 0; h < H; ++h)
          result.y[size_t(r)][size_t(t * H + h)] += w * ex.z[size_t(row * H + h)];
      }
  *out = std::move(result);
  return Status::success();
}

template <typename T>
Status backward(const LayerShape &shape, const std::vector<RankInputs<T>> &inputs,
                const Weights<T> &weights, const Forward<T> &fwd,
                const std::vector<std::vector<T>> &dy, Backward<T> *out,
                const Progress &progress) {
  if (Status status = validateInputs(shape, inputs, weights); !status)
    return status;
  const int64_t R = shape.ranks, E = int64_t(shape.experts()), H = shape.hidden, I = shape.inter,
                K = shape.topK, S = shape.tokens;
  if (int64_t(dy.size()) != R)
    return Status::error("layer: " + std::to_string(dy.size()) + " dy tensors for " +
                         std::to_string(R) + " ranks");
  for (int64_t r = 0; r < R; ++r)
    if (int64_t(dy[size_t(r)].size()) != S * H)
      return Status::error("rank " + std::to_string(r) + ": " +
                           sizeError("dy", dy[size_t(r)].size(), S * H));
  if (int64_t(fwd.experts.size()) != E)
    return Status::error("layer: the forward results have " + std::to_string(fwd.experts.size()) +
                         " experts, expected " + std::to_string(E));

  Backward<T> result;
  result.dx.assign(size_t(R), std::vector<T>(size_t(S * H), T(0)));
  result.dtopkWeights.assign(size_t(R), std::vector<T>(size_t(S * K), T(0)));
  result.dw1.assign(size_t(E * H * 2 * I), T(0));
  result.dw2.assign(size_t(E * I * H), T(0));

  for (int64_t e = 0; e < E; ++e) {
    const ExpertActivations<T> &ex = fwd.experts[size_t(e)];
    const int64_t n = int64_t(ex.rows.size());
    const T *w1 = weights.w1.data() + e * H * 2 * I;
    const T *w2 = weights.w2.data() + e * I * H;
    T *dw1 = result.dw1.data() + e * H * 2 * I;
    T *dw2 = result.dw2.data() + e * I * H;

    // dtopk_weights[t, k] = <dy[t], Z row>; dZ row = w[t, k] * dy[t].
    std::vector<T> dz(size_t(n * H));
    for (int64_t m = 0; m < n; ++m) {
      const RowSource &src = ex.rows[size_t(m)];
      const std::vector<T> &g = dy[size_t(src.rank)];
      T dot = 0;
      for (int64_t h = 0; h < H; ++h)
        dot += g[size_t(src.token * H + h)] * ex.z[size_t(m * H + h)];
      result.dtopkWeights[size_t(src.rank)][size_t(src.token * K + src.k)] = dot;
      const T w = inputs[size_t(src.rank)].topkWeights[size_t(src.token * K + src.k)];
      for (int64_t h = 0; h < H; ++h)
        dz[size_t(m * H + h)] = w * g[size_t(src.token * H + h)];
    }

    // dA = dZ w2^T: dA[m, i] = sum_h dZ[m, h] * w2[i, h].
    std::vector<T> da(size_t(n * I));
    for (int64_t m = 0; m < n; ++m)
      for (int64_t i = 0; i < I; ++i) {
        T sum = 0;
        for (int64_t h = 0; h < H; ++h)
          sum += dz[size_t(m * H + h)] * w2[i * H + h];
        da[size_t(m * I + i)] = sum;
      }

    // dw2 = A^T dZ: dw2[i, h] = sum_m A[m, i] * dZ[m, h].
    for (int64_t i = 0; i < I; ++i)
      for (int64_t h = 0; h < H; ++h) {
        T sum = 0;
        for (int64_t m = 0; m < n; ++m)
          sum += ex.a[size_t(m * I + i)] * dz[size_t(m * H + h)];
        dw2[i * H + h] = sum;
      }

    // dY = swiglu_grad(Y, dA).
    std::vector<T> dY(size_t(n * 2 * I));
    for (int64_t m = 0; m < n; ++m)
      for (int64_t i = 0; i < I; ++i) {
        const T gate = ex.y[size_t(m * 2 * I + i)];
        const T up = ex.y[size_t(m * 2 * I + I + i)];
        const T g = da[size_t(m * I + i)];
        dY[size_t(m * 2 * I + i)] = g * up * siluGrad(gate);
        dY[size_t(m * 2 * I + I + i)] = g * silu(gate);
      }

    // dX = dY w1^T: dX[m, h] = sum_j dY[m, j] * w1[h, j]; dx[t] += dX row.
    for (int64_t m = 0; m < n; ++m) {
      const RowSource &src = ex.rows[size_t(m)];
      for (int64_t h = 0; h < H; ++h) {
        T sum = 0;
        for (int64_t j = 0; j < 2 * I; ++j)
          sum += dY[size_t(m * 2 * I + j)] * w1[h * 2 * I + j];
        result.dx[size_t(src.rank)][size_t(src.token * H + h)] += sum;
      }
    }

    // dw1 = X^T dY: dw1[h, j] = sum_m X[m, h] * dY[m, j].
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = 0; j < 2 * I; ++j) {
        T sum = 0;
        for (int64_t m = 0; m < n; ++m)
          sum += ex.x[size_t(m * H + h)] * dY[size_t(m * 2 * I + j)];
        dw1[h * 2 * I + j] = sum;
      }
    if (progress)
      progress(double(e + 1) / double(E));
  }
  *out = std::move(result);
  return Status::success();
}

template <typename T>
Status sampled(const LayerShape &shape, const InputView<T> &in, const Sample &sample,
               SampleOutputs<double> *out, const Progress &progress) {
  if (Status status = validateShape(shape); !status)
    return status;
  const int64_t R = shape.ranks, E = int64_t(shape.experts()), H = shape.hidden, I = shape.inter,
                K = shape.topK, S = shape.tokens;
  const bool backward = in.dy != nullptr;
  // Every token's top-k ids: in range and distinct (a unit reads them all).
  for (int64_t g = 0; g < R * S; ++g)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t id = in.topkIds[g * K + k];
      const std::string where = "rank " + std::to_string(g / std::max<int64_t>(1, S)) + ": ";
      if (id < 0 || id >= E)
        return Status::error(where + "topk_ids[" + std::to_string(g % S) + "][" +
                             std::to_string(k) + "] = " + std::to_string(id) +
                             " is not an expert");
      for (int64_t j = 0; j < k; ++j)
        if (in.topkIds[g * K + j] == id)
          return Status::error(where + "token " + std::to_string(g % S) + " routes to expert " +
                               std::to_string(id) + " twice");
    }
  for (int64_t g : sample.tokens)
    if (g < 0 || g >= R * S)
      return Status::error("sample: token " + std::to_string(g) + " is not one of the " +
                           std::to_string(R * S) + " tokens");
  for (const auto &[e, i] : sample.units)
    if (e < 0 || e >= E || i < 0 || i >= I)
      return Status::error("sample: unit (" + std::to_string(e) + ", " + std::to_string(i) +
                           ") is not a unit of " + std::to_string(E) + " experts x " +
                           std::to_string(I));

  SampleOutputs<double> result;
  const size_t N = sample.tokens.size(), U = sample.units.size();
  const int64_t r = in.loraRank;
  const double s = in.loraScale;
  const bool lora1 = in.loraA[0] && in.loraB[0] && r > 0,
             lora2 = in.loraA[1] && in.loraB[1] && r > 0;
  result.y.assign(N * size_t(H), 0.0);
  if (backward) {
    result.dx.assign(N * size_t(H), 0.0);
    result.dtopk.assign(N * size_t(K), 0.0);
    result.dw1.assign(U * size_t(2 * H), 0.0);
    result.dw2.assign(U * size_t(H), 0.0);
    if (lora1)
      result.dloraB1.assign(U * size_t(2 * r), 0.0);
    if (lora2)
      result.dloraA2.assign(U * size_t(r), 0.0);
  }
  // The adapters' products: u = v A (v K wide) and the added B's column j,
  // sum_q u[q] B[q, j].
  const auto timesA = [&](int p, int64_t e, const double *v, int64_t rows, double *u) {
    const T *a = in.loraA[p] + e * rows * r;
    for (int64_t q = 0; q < r; ++q)
      u[q] = 0;
    for (int64_t k = 0; k < rows; ++k)
      for (int64_t q = 0; q < r; ++q)
        u[q] += v[k] * double(a[k * r + q]);
  };
  const auto bColumn = [&](int p, int64_t e, const double *u, int64_t cols, int64_t j) {
    const T *b = in.loraB[p] + e * r * cols;
    double sum = 0;
    for (int64_t q = 0; q < r; ++q)
      sum += u[q] * double(b[q * cols + j]);
    return sum;
  };
  // t = B g (g N wide, t r wide): the adapter's share of g W^T is A t.
  const auto timesBt = [&](int p, int64_t e, const double *g, int64_t cols, double *t) {
    const T *b = in.loraB[p] + e * r * cols;
    for (int64_t q = 0; q < r; ++q) {
      double sum = 0;
      for (int64_t j = 0; j < cols; ++j)
        sum += double(b[q * cols + j]) * g[j];
      t[q] = sum;
    }
  };
  const auto aRow = [&](int p, int64_t e, const double *t, int64_t rows, int64_t k) {
    const T *a = in.loraA[p] + (e * rows + k) * r;
    double sum = 0;
    for (int64_t q = 0; q < r; ++q)
      sum += double(a[q]) * t[q];
    return sum;
  };
  const size_t hs = static_cast<size_t>(H), rs = static_cast<size_t>(r);
  std::vector<double> xd(hs), gy(hs), u1(rs), u2(rs), t1(rs), t2(rs);

  // Tokens: each of its K experts' FFN on its row, as forward() and
  // backward() compute it for that row.
  const size_t twoI = size_t(2 * I), oneI = size_t(I), oneH = size_t(H);
  std::vector<double> y(twoI), a(oneI), z(oneH), da(oneI), dY(twoI);
  for (size_t n = 0; n < N; ++n) {
    const int64_t tok = sample.tokens[n];
    const T *x = in.x + tok * H;
    for (int64_t h = 0; h < H; ++h)
      xd[size_t(h)] = double(x[h]);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = in.topkIds[tok * K + k];
      const T *w1 = in.w1 + e * H * 2 * I;
      const T *w2 = in.w2 + e * I * H;
      const double w = double(in.topkWeights[tok * K + k]);
      if (lora1)
        timesA(0, e, xd.data(), H, u1.data());
      for (int64_t j = 0; j < 2 * I; ++j) {
        double sum = 0;
        for (int64_t h = 0; h < H; ++h)
          sum += double(x[h]) * double(w1[h * 2 * I + j]);
        y[size_t(j)] = sum + (lora1 ? s * bColumn(0, e, u1.data(), 2 * I, j) : 0.0);
      }
      for (int64_t i = 0; i < I; ++i)
        a[size_t(i)] = silu(y[size_t(i)]) * y[size_t(I + i)];
      if (lora2)
        timesA(1, e, a.data(), I, u2.data());
      for (int64_t h = 0; h < H; ++h) {
        double sum = 0;
        for (int64_t i = 0; i < I; ++i)
          sum += a[size_t(i)] * double(w2[i * H + h]);
        if (lora2)
          sum += s * bColumn(1, e, u2.data(), H, h);
        z[size_t(h)] = sum;
        result.y[n * size_t(H) + size_t(h)] += w * sum;
      }
      if (!backward)
        continue;
      const T *dy = in.dy + tok * H;
      double dot = 0;
      for (int64_t h = 0; h < H; ++h) {
        dot += double(dy[h]) * z[size_t(h)];
        gy[size_t(h)] = w * double(dy[h]);
      }
      result.dtopk[n * size_t(K) + size_t(k)] = dot;
      if (lora2)
        timesBt(1, e, gy.data(), H, t2.data());
      for (int64_t i = 0; i < I; ++i) {
        double sum = 0;
        for (int64_t h = 0; h < H; ++h)
          sum += w * double(dy[h]) * double(w2[i * H + h]);
        da[size_t(i)] = sum + (lora2 ? s * aRow(1, e, t2.data(), I, i) : 0.0);
      }
      for (int64_t i = 0; i < I; ++i) {
        const double gate = y[size_t(i)], up = y[size_t(I + i)], g2 = da[size_t(i)];
        dY[size_t(i)] = g2 * up * siluGrad(gate);
        dY[size_t(I + i)] = g2 * silu(gate);
      }
      if (lora1)
        timesBt(0, e, dY.data(), 2 * I, t1.data());
      for (int64_t h = 0; h < H; ++h) {
        double sum = 0;
        for (int64_t j = 0; j < 2 * I; ++j)
          sum += dY[size_t(j)] * double(w1[h * 2 * I + j]);
        if (lora1)
          sum += s * aRow(0, e, t1.data(), H, h);
        result.dx[n * size_t(H) + size_t(h)] += sum;
      }
    }
    if (progress)
      progress(double(n + 1) / double(N + U));
  }

  // Units: over every row routed to the expert, in dispatch order (rank,
  // token, k), the unit's gate and up, A, dA and their gradients.
  if (backward && U > 0) {
    const size_t experts = size_t(E);
    std::vector<std::vector<std::pair<int64_t, int64_t>>> rowsOf(experts); // (g, k)
    std::vector<bool> wanted(experts, false);
    for (const auto &unit : sample.units)
      wanted[size_t(unit.first)] = true;
    for (int64_t g = 0; g < R * S; ++g)
      for (int64_t k = 0; k < K; ++k)
        if (wanted[size_t(in.topkIds[g * K + k])])
          rowsOf[size_t(in.topkIds[g * K + k])].push_back({g, k});
    for (size_t u = 0; u < U; ++u) {
      const auto [e, i] = sample.units[u];
      const T *w1 = in.w1 + e * H * 2 * I;
      const T *w2 = in.w2 + e * I * H;
      double *dw1 = result.dw1.data() + u * size_t(2 * H);
      double *dw2 = result.dw2.data() + u * size_t(H);
      for (const auto &[tok, k] : rowsOf[size_t(e)]) {
        const T *x = in.x + tok * H;
        const T *dy = in.dy + tok * H;
        const double w = double(in.topkWeights[tok * K + k]);
        double gate = 0, up = 0, dA = 0;
        for (int64_t h = 0; h < H; ++h) {
          gate += double(x[h]) * double(w1[h * 2 * I + i]);
          up += double(x[h]) * double(w1[h * 2 * I + I + i]);
          dA += w * double(dy[h]) * double(w2[i * H + h]);
          xd[size_t(h)] = double(x[h]);
          gy[size_t(h)] = w * double(dy[h]);
        }
        if (lora1) {
          timesA(0, e, xd.data(), H, u1.data());
          gate += s * bColumn(0, e, u1.data(), 2 * I, i);
          up += s * bColumn(0, e, u1.data(), 2 * I, I + i);
        }
        if (lora2) {
          timesBt(1, e, gy.data(), H, t2.data());
          dA += s * aRow(1, e, t2.data(), I, i);
        }
        const double act = silu(gate) * up;
        const double dGate = dA * up * siluGrad(gate), dUp = dA * silu(gate);
        for (int64_t h = 0; h < H; ++h) {
          dw2[h] += act * (w * double(dy[h]));
          dw1[2 * h] += double(x[h]) * dGate;
          dw1[2 * h + 1] += double(x[h]) * dUp;
        }
        // dB1 = s (X A1)^T dY over the rows: its columns i and I + i;
        // dA2 = s A^T (dZ B2^T): its row i.
        for (int64_t q = 0; lora1 && q < r; ++q) {
          result.dloraB1[u * size_t(2 * r) + size_t(2 * q)] += s * u1[size_t(q)] * dGate;
          result.dloraB1[u * size_t(2 * r) + size_t(2 * q + 1)] += s * u1[size_t(q)] * dUp;
        }
        for (int64_t q = 0; lora2 && q < r; ++q)
          result.dloraA2[u * size_t(r) + size_t(q)] += s * act * t2[size_t(q)];
      }
      if (progress)
        progress(double(N + u + 1) / double(N + U));
    }
  }
  *out = std::move(result);
  return Status::success();
}

#define MOEC_REFERENCE_INSTANTIATE(T)                                                              \
  template T silu<T>(T);                                                                           \
  template T siluGrad<T>(T);                                                                       \
  template void matmul<T>(int64_t, int64_t, int64_t, const T *, const T *, T *);                   \
  template Status validateInputs<T>(const LayerShape &, const std::vector<RankInputs<T>> &,        \
                                    const Weights<T> &);                                           \
  template Status forward<T>(const LayerShape &, const std::vector<RankInputs<T>> &,               \
                             const Weights<T> &, Forward<T> *, const Progress &);                  \
  template Status backward<T>(const LayerShape &, const std::vector<RankInputs<T>> &,              \
                              const Weights<T> &, const Forward<T> &,                              \
                              const std::vector<std::vector<T>> &, Backward<T> *,              \
                              const Progress &);                                               \
  template Status sampled<T>(const LayerShape &, const InputView<T> &, const Sample &,             \
                             SampleOutputs<double> *, const Progress &);

MOEC_REFERENCE_INSTANTIATE(float)
MOEC_REFERENCE_INSTANTIATE(double)

#undef MOEC_REFERENCE_INSTANTIATE

} // namespace moec::reference
