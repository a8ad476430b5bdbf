//===- LayerRun.h - Inputs, runs and checks of a whole layer ----*- C++ -*-===//
//
// What `moec run` and `moec bench` share: the layer's inputs for every rank
// of an EP group as plain fp32 arrays (read from .npy files or made at
// random, uniform or skewed), a LayerRun that holds them in the binary's
// storage type (bf16 converted at the edges), binds them to a runtime context
// and runs forward and backward, and a check of the outputs against the
// reference layer (runtime/tooling/Reference.h, in double).
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_TOOLING_LAYERRUN_H
#define MOEC_RUNTIME_TOOLING_LAYERRUN_H

#include "runtime/api/Runtime.h"

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace moec::tooling {

/// The layer's tensors for all EP ranks, fp32 (ids int64), global shapes:
/// under tensor parallelism (tp > 1) the full experts, which LayerRun
/// slices for each TP rank (w1's gate and up columns, w2's rows), and the
/// tokens of each EP rank, which its TP ranks share.
struct LayerData {
  int64_t ranks = 1; ///< P, the EP ranks
  int64_t tp = 1;    ///< T, the TP ranks of each
  int64_t tokens = 0, topK = 1, experts = 1, hidden = 0;
  int64_t inter = 0; ///< I of a whole expert (T times a rank's)
  std::vector<float> x;         ///< [R, S, H]
  std::vector<int64_t> ids;     ///< [R, S, K]
  std::vector<float> weights;   ///< [R, S, K]
  std::vector<float> w1;        ///< [E, H, 2I]
  std::vector<float> w2;        ///< [E, I, H]
  std::vector<float> dy;        ///< [R, S, H] (backward)
  /// LoRA adapters on the experts (a binary with them; its base weights
  /// frozen): their rank r, the factor s of their products (U = s X A,
  /// Y = X W + U B) and, per projection p (0: w1, 1: w2, as loraTargets'
  /// bits say), A [E, K, r] and B [E, r, N], K x N the projection's
  /// weight (H x 2I, I x H). Empty where the binary has none.
  int64_t loraRank = 0;
  uint8_t loraTargets = 0;
  float loraScale = 0;
  std::array<std::vector<float>, 2> loraA, loraB;
  // Outputs.
  std::vector<float> y, dx, dtopk, dw1, dw2;
  std::array<std::vector<float>, 2> dLoraA, dLoraB; ///< as loraA, loraB (backward)
};

/// One LoRA tensor of a layer: projection p's A or B (`b`), or with
/// `grad` its gradient.
struct LoraTensor {
  int p = 0;
  bool b = false, grad = false;
  /// "lora_a1", "lora_b2", "dlora_a1", ...
  std::string name() const;
  /// Its dims for `d`: [E, K, r] (A) or [E, r, N] (B), global experts.
  std::vector<int64_t> dims(const LayerData &d) const;
  /// Its values of one expert: K r or r N.
  int64_t perExpert(const LayerData &d) const;
  /// Whether a TP rank holds a slice of it (B of w1's adapter: the gate and
  /// up columns of the rank's slice of I; A of w2's: its rows) rather than
  /// all of it (A of w1's, B of w2's: their gradients are partial sums over
  /// the TP ranks).
  bool sliced() const { return b == (p == 0); }
  /// Its values of one expert on one of `d.tp` TP ranks.
  int64_t perExpertOnRank(const LayerData &d) const {
    return sliced() ? perExpert(d) / d.tp : perExpert(d);
  }
  /// Its values in `d`.
  std::vector<float> &of(LayerData &d) const;
  const std::vector<float> &of(const LayerData &d) const;
};

/// The LoRA tensors of adapters on `targets` (LayerShape::loraTargets): A
/// and B of each, or with `grads` their gradients.
std::vector<LoraTensor> loraTensors(uint8_t targets, bool grads);

/// Options of randomLayerData.
struct RandomOptions {
  uint64_t seed = 1;
  /// The share of tokens whose first choice is expert 0 (the rest pick at
  /// random); 0 is uniform routing.
  double hotShare = 0;
  /// Round every value to bf16 (for a bf16 binary, so the reference sees
  /// what the runtime sees).
  bool bf16 = false;
};

/// Fills `data` with random inputs for `shape` (S and K from the binary):
/// x, dy uniform in [-1, 1), weights scaled by 1/sqrt(fan-in), top-k weights
/// in (0.2, 1), distinct experts per token; LoRA adapters where the binary
/// has them, A by 1/sqrt(its fan-in) and B by 1/sqrt(r) (not zero, as a
/// fresh adapter's B is, so that their products count in the outputs).
/// Each value of x, dy, w1, w2 and the adapters is a hash of the seed, the
/// tensor and its index (filled on every hardware thread, the same values
/// for any thread count); the routing comes from one stream of the seed.
void randomLayerData(const rt::LayerShape &shape, const RandomOptions &options, LayerData *data);

/// The files of a layer's inputs in a folder: x, topk_ids, topk_weights, w1,
/// w2 (.npy), dy with a backward pass, and the LoRA adapters' A and B on
/// `loraTargets`.
std::vector<std::string> layerInputFiles(bool backward, uint8_t loraTargets = 0);

/// Reads x, topk_ids, topk_weights, w1, w2 (and dy when `backward`, and
/// the LoRA adapters of a binary with them) from DIR/*.npy and checks their
/// shapes against each other and `shape`. The folder must be a run's, as its
/// manifest says (checkRunManifest), unless `handMade`. Errors name the file
/// and what was expected.
Status readLayerInputs(const std::string &dir, const rt::LayerShape &shape, bool backward,
                       bool handMade, LayerData *data);

/// Writes the inputs (with dy when `backward`, and the LoRA adapters) to
/// DIR/*.npy; appends the names of the files to *written.
Status writeLayerInputs(const std::string &dir, const LayerData &data, bool backward,
                        std::vector<std::string> *written);

/// Writes y (and dx, dtopk_weights, dw1, dw2 or the LoRA adapters'
/// gradients when `backward`) to DIR/*.npy; appends the names of the files
/// to *written.
Status writeLayerOutputs(const std::string &dir, const LayerData &data, bool backward,
                         std::vector<std::string> *written);

/// A folder of outputs is one run's when it holds this manifest, which the
/// run writes last: what ran, and each file it wrote with its size and
/// CRC-32. A run replaces its outputs folder whole (RunFolder), so a folder
/// holds one run's files and its manifest, or an earlier run's.
inline constexpr const char *kRunManifest = "manifest.json";

/// The names a run writes into its outputs folder: y (and dx,
/// dtopk_weights, dw1, dw2 or the gradients of the LoRA adapters on
/// `loraTargets` with a backward pass), the inputs when it made them
/// (`inputs`: --random), and the manifest.
std::vector<std::string> runFolderFiles(bool backward, bool inputs, uint8_t loraTargets = 0);

/// True for a name any run writes into its folder.
bool isRunFileName(const std::string &name);

/// The outputs folder of a run, replaced whole or not at all. open() creates
/// the folder when missing, locks it (a second run writing the same folder
/// at once is refused, naming it), refuses it when it holds a file no run
/// writes (the user's own, an input binary), a file the run will write
/// (`writes`) as a symbolic link or another kind of file, or one of
/// `inputs` under another name; removes new folders of runs that died
/// (".NAME.moec-new.PID" beside it, PID no longer running) and makes this
/// run's. The run writes its files into path(); finish() links in the files
/// of the old folder that are this run's too (`kept`: inputs read from it),
/// writes the manifest and swaps the new folder with the old one in one
/// step (renameat2 RENAME_EXCHANGE), then removes the old. A run that fails
/// or is killed leaves the folder as it was (and, killed, a new folder that
/// the next run removes).
class RunFolder {
public:
  static Status open(const std::string &dir, const std::vector<std::string> &writes,
                     const std::vector<std::string> &inputs, std::unique_ptr<RunFolder> *out);
  ~RunFolder();
  RunFolder(const RunFolder &) = delete;
  RunFolder &operator=(const RunFolder &) = delete;

  /// Where the run writes its files until finish().
  const std::string &path() const { return staging; }

  /// `status` with the new folder's path in its message replaced by the
  /// outputs folder's, as the user named it.
  Status named(const Status &status) const;

  /// Writes the manifest for `files` (names in path()) with `run`
  /// describing what ran, carries `kept` over, and puts the new folder in
  /// place of the old.
  Status finish(const std::vector<std::string> &files, const std::string &run,
                const std::vector<std::string> &kept = {});

private:
  RunFolder() = default;
  std::string dir;     ///< as given
  std::string target;  ///< the real folder (symbolic links resolved)
  std::string staging; ///< the new folder beside it
  int fd = -1;
  bool created = false;
};

/// Checks the manifest of `dir`: every file it lists is there with its size
/// and CRC-32; sets *listed to their names. A folder without one is refused
/// (a run killed before it swapped its folder in leaves none: readers are
/// told to say --hand-made for a folder they made themselves).
Status checkRunManifest(const std::string &dir,
                        std::optional<std::set<std::string>> *listed = nullptr);

/// Where `shape`'s base weights are stored quantized (FP8 blocks), replaces
/// w1 and w2 of `data` by the values the layer computes with: each expert's
/// matrix, as the binary stores it, quantized and dequantized. The inputs a
/// run writes and the reference it is verified against then hold those.
/// An error where the format does not go with the layout (TP > 1).
Status roundWeightsToFormat(const rt::LayerShape &shape, LayerData *data);

/// One rank's base weights as a binary of `shape` stores them: w1 and w2
/// in its weight type (LayerShape::weightDType) and layout (transposed,
/// quantized: LayerShape::storedDims), as bytes, and the scales of
/// quantized ones (LayerShape::scaleDims; empty when dense).
struct StoredWeights {
  DType dtype = DType::F32;
  std::vector<uint8_t> w1, w2;
  std::vector<float> w1Scale, w2Scale;
  std::vector<int64_t> w1Dims, w2Dims, w1ScaleDims, w2ScaleDims;
};

/// Rank `rank`'s weights of `data` (EP rank rank / T's experts, TP slice
/// rank % T of each) as `shape` stores them.
StoredWeights storedWeights(const rt::LayerShape &shape, const LayerData &data, int64_t rank);

/// Where a LayerRun keeps the tensors it binds when they are not to lie in
/// host memory (a GPU's memory, so that a pass reads its own and not host
/// tensors it stages): the calls it makes of it. Each returns an error's
/// text, empty on success.
struct TensorMemory {
  virtual ~TensorMemory() = default;
  virtual std::string allocate(size_t bytes, void **memory) = 0;
  virtual void release(void *memory) = 0;
  /// Copies `bytes` from host memory to this memory or back.
  virtual std::string copy(void *to, const void *from, size_t bytes) = 0;
};

/// The inputs of a LayerData in the binary's storage types, bound to a
/// context; run() runs the passes and copies the outputs back as fp32.
class LayerRun {
public:
  /// Tensors in host memory, or with `memory` in that memory (which must
  /// outlive the LayerRun).
  explicit LayerRun(TensorMemory *memory = nullptr) : memory(memory) {}
  /// Converts and binds `data`'s inputs (for all ranks) to `context`: rank
  /// r gets EP rank r / T's tokens and TP slice r % T of its experts.
  Status bind(rt::Context &context, const LayerData &data);
  /// Runs forward (and backward) and stores the outputs in `data`: the
  /// tokens' outputs from TP rank 0 of each EP rank (an error when another
  /// TP rank's differ in a bit), the weight gradients put together from
  /// the slices.
  Status run(rt::Context &context, bool backward, LayerData *data);

private:
  /// One bound tensor: its values in host memory, and with a TensorMemory
  /// a copy there, which is what is bound.
  struct Buffer {
    std::vector<float> f32;
    std::vector<uint16_t> bf16;
    std::vector<uint8_t> bytes; ///< a weight as stored (StoredWeights)
    format::DType dtype = format::DType::F32;
    std::shared_ptr<void> placed; ///< the copy in the TensorMemory
    void assign(const float *values, size_t count, format::DType type);
    void zeros(size_t count, format::DType type);
    /// Sets every element to zero where it is (a bound tensor stays bound).
    void clear();
    void *host() {
      return !bytes.empty()                 ? (void *)bytes.data()
             : dtype == format::DType::BF16 ? (void *)bf16.data()
                                            : (void *)f32.data();
    }
    size_t size() const {
      return !bytes.empty()                 ? bytes.size()
             : dtype == format::DType::BF16 ? bf16.size() * 2
                                            : f32.size() * 4;
    }
    void *data() { return placed ? placed.get() : host(); }
    void copyOut(float *out) const;
  };
  /// Copies `b`'s host values to `memory` (made the first time), or back;
  /// the first failure is kept in `failure`.
  void place(Buffer &b);
  void fetch(Buffer &b);
  TensorMemory *memory = nullptr;
  std::string failure;
  std::vector<Buffer> buffers; ///< per rank: x, y, w1, w2, dy, dx, dw1, dw2, scales, dtopk
  std::vector<std::vector<int64_t>> ids;
  std::vector<std::vector<float>> weights;
};

/// The error of one output against the reference.
struct OutputError {
  std::string name;
  double maxAbs = 0;  ///< max |out - ref| over the elements finite in both
  double maxRel = 0;  ///< max |out - ref| / max |ref|
  double tolerance = 0;
  int64_t nonFinite = 0;  ///< elements that are NaN or infinite in the output
  int64_t mismatched = 0; ///< of the elements non-finite in either, those that
                          ///< differ (NaN against a number, +inf against -inf)
  bool ok() const { return mismatched == 0 && maxRel <= tolerance; }
};

/// What verifyLayer checks and how.
struct VerifyOptions {
  bool backward = false; ///< check dx, dtopk_weights, dw1, dw2 (or the adapters') too
  bool bf16 = false;     ///< the binary stores bf16: the looser tolerance
  /// The forward's dispatch moves FP8 rows: the reference takes x through
  /// the same quantization (e4m3, fp32 scale per 128 values) and back to
  /// the compute dtype, the rows the experts see, before it runs.
  bool fp8Dispatch = false;
  /// 0: run the whole reference layer. N > 0: check N random tokens (y, and
  /// with `backward` dx and dtopk_weights) and, for each expert they route
  /// to, one random intermediate unit's weight gradients (a row of dw2, a
  /// gate and an up column of dw1), in memory that grows with N only.
  int64_t sampleTokens = 0;
  uint64_t seed = 1;     ///< picks the sample
  /// Told the share of the reference done (0..1); may be empty.
  std::function<void(double)> progress;
};

/// What a sampled check covered.
struct SampleSummary {
  int64_t tokens = 0, units = 0;
  /// Outputs no sample covers (a LoRA adapter's dlora_a1 and dlora_b2: each
  /// row's every unit), left unchecked.
  std::vector<std::string> unsampled;
};

/// Runs the reference on `data`'s inputs and compares its outputs
/// (y; and dx, dtopk_weights, dw1, dw2 with `backward`), whole or sampled.
/// With LoRA adapters the whole reference runs on w + s A B, and the
/// adapters' gradients follow from that weight's gradient G: dA = s G B^T,
/// dB = s A^T G; a sampled one adds the adapters' products to the sampled
/// tokens' rows and checks the sampled units' columns of dlora_b1 and rows
/// of dlora_a2 (SampleSummary::unsampled names the rest).
Status verifyLayer(const LayerData &data, const VerifyOptions &options,
                   std::vector<OutputError> *errors, SampleSummary *summary = nullptr);

/// The memory the whole reference layer (options.sampleTokens = 0) needs in
/// double for a layer of `shape` (at most its compiled S tokens per rank),
/// beyond the layer's data: its copies of the inputs, every expert's
/// activations and the outputs.
double verifyBytes(const rt::LayerShape &shape, bool backward);

} // namespace moec::tooling

#endif // MOEC_RUNTIME_TOOLING_LAYERRUN_H
