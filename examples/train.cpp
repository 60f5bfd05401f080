// membound's example trainer: a byte-level hybrid language model (TTT, attention, Mamba blocks)
// trained on tiny-shakespeare (or any text file) inside a memory budget. Before step 1 it prints
// the plan; the loop is membound::trainer (train/trainer.hpp), every step allocates from a hard
// budget allocator whose measured peak is checked against the plan's prediction, and a pressure
// monitor retries a step under a stricter plan when memory runs short.
//
//   ./build/release/examples/train                                  # the default run
//   ./build/release/examples/train --budget 256MiB --layers ttt,attn,mamba,attn --schedule auto
//   ./build/release/examples/train --steps 50 --save-every 25 --checkpoint /tmp/run.ckpt
//   ./build/release/examples/train --resume /tmp/run.ckpt --steps 100 --report run.json
//   ./build/release/examples/train --steps 60 --foreign 10MiB@30 --trace t.json  # pressure at step 30
//   mpirun -np 2 ./build/release/examples/train                     # data parallel over 2 ranks (with MPI)
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <csignal>

#include <sys/ioctl.h>
#include <unistd.h>

#include "cli_checks.hpp"
#include "membound/membound.hpp"
#include "train_common.hpp"
#if MEMBOUND_EXAMPLE_MPI
#include <cstdlib>

#include "membound/mpi.hpp"
#endif

namespace mb = membound;

#if MEMBOUND_EXAMPLE_CUDA
#include <dlfcn.h>

#include <climits>

// The device half, loaded on first use: libtrain_cuda.so next to this executable (where a copy of
// both was put), else where the build wrote it. A CPU run never loads it (on a machine without an
// NVIDIA device node, not even to look for a GPU), so it maps none of the
// CUDA libraries (linked in, cudart and cuBLASLt took the CPU run's baseline RSS from 16 to 165 MiB).
// Over several mpirun ranks a GPU run loads libtrain_cuda_nccl.so instead (the same source over
// NCCL), so that a one-GPU run never needs libnccl.
namespace train_example {
namespace {
struct cuda_module {
  bool (*present)() = nullptr;
  std::size_t (*memory)() = nullptr;
  int (*run)(const options*, const std::vector<std::int32_t>*) = nullptr;
  std::string error;  // why it could not be loaded
};
cuda_module load_module(const std::string& file, const char* built_at) {
  cuda_module c;
  std::vector<std::string> paths;
  char exe[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n > 0) {
    std::string dir(exe, static_cast<std::size_t>(n));
    paths.push_back(dir.substr(0, dir.find_last_of('/') + 1) + file);
  }
  if (built_at != nullptr) paths.push_back(built_at);
  void* h = nullptr;
  for (const std::string& p : paths) {
    if ((h = ::dlopen(p.c_str(), RTLD_NOW | RTLD_LOCAL)) != nullptr) break;
    const char* e = ::dlerror();
    c.error += (c.error.empty() ? "" : "; ") + p + ": " + (e != nullptr ? e : "not loaded");
  }
  if (h == nullptr) return c;
  c.present = reinterpret_cast<bool (*)()>(::dlsym(h, "membound_train_cuda_present"));
  c.memory = reinterpret_cast<std::size_t (*)()>(::dlsym(h, "membound_train_cuda_memory"));
  c.run = reinterpret_cast<int (*)(const options*, const std::vector<std::int32_t>*)>(
      ::dlsym(h, "membound_train_cuda_run"));
  if (c.present == nullptr || c.memory == nullptr || c.run == nullptr) {
    c = cuda_module{};
    c.error = file + " lacks its entry points (a module of another build?)";
  }
  return c;
}
const cuda_module& cuda_half() {
  static const cuda_module m = load_module("libtrain_cuda.so", MEMBOUND_TRAIN_CUDA_MODULE);
  return m;
}
#ifdef MEMBOUND_TRAIN_CUDA_NCCL_MODULE
constexpr const char* nccl_module_built_at = MEMBOUND_TRAIN_CUDA_NCCL_MODULE;
#else
constexpr const char* nccl_module_built_at = nullptr;  // not configured: NCCL or MPI was not found
#endif
const cuda_module& cuda_ranks_half() {
  static const cuda_module m = load_module("libtrain_cuda_nccl.so", nccl_module_built_at);
  return m;
}
}  // namespace

// Without an NVIDIA device node there is no GPU to ask about: the module is not even loaded.
bool cuda_device_present() {
  if (::access("/dev/nvidiactl", F_OK) != 0 && ::access("/dev/dxg", F_OK) != 0) return false;
  return cuda_half().present != nullptr && cuda_half().present();
}
std::size_t cuda_device_memory() { return cuda_half().memory(); }
int run_on_device(const options& o, const std::vector<std::int32_t>& text) { return cuda_half().run(&o, &text); }
int run_on_device_ranks(const options& o, const std::vector<std::int32_t>& text) {
  const cuda_module& m = cuda_ranks_half();
  if (m.run == nullptr) {
    throw mb::invalid_argument("--device", "cpu under mpirun, or cuda with the NCCL module (libtrain_cuda_nccl.so)",
                               "cuda under mpirun, whose module could not be loaded: " +
                                   (m.error.empty() ? std::string("none was built") : m.error),
                               nccl_module_built_at != nullptr
                                   ? "Build it (cmake --build build/release --target train_cuda_nccl), or pass --device cpu"
                                   : "This build found no NCCL (or no MPI) at configure time: pass --device cpu");
  }
  return m.run(&o, &text);
}
}  // namespace train_example
#endif

namespace {

using namespace train_example;

// Every flag as the text given; CLI11 only splits the command line, so that a number is read by
// the strict rules of cli_checks.hpp ("-1" is refused, never wrapped to 2^64 - 1).
struct flag_texts {
  std::map<std::string, std::string> text;
  const CLI::App* app = nullptr;
  bool given(const std::string& flag) const { return app->count(flag) > 0; }
  const std::string& operator[](const std::string& flag) const { return text.at(flag); }
};

// none, full, every:K or binomial:S with K, S from 1 to the number of blocks (beyond that they
// plan the same as at it).
mb::schedule_choice parse_schedule(const std::string& s, std::size_t depth) {
  using K = mb::schedule_choice::kind;
  const std::string bound = " (at most the " + std::to_string(depth) + " blocks of --layers)";
  if (s == "none") return {K::none, 0};
  if (s == "full") return {K::full, 0};
  if (s.starts_with("every:")) {
    return {K::every, cli_checks::whole("--schedule every:K", s.substr(6), 1, depth, "--schedule every:2", bound)};
  }
  if (s.starts_with("binomial:")) {
    return {K::binomial,
            cli_checks::whole("--schedule binomial:S", s.substr(9), 1, depth, "--schedule binomial:2", bound)};
  }
  throw mb::invalid_argument("--schedule", "auto, none, full, every:K or binomial:S", cli_checks::in_quotes(s),
                             "e.g. --schedule auto");
}

// Every flag, each on its own and then against the flags it depends on, in the order of those
// dependencies (--steps before --warmup, --layers before --schedule, --budget before --foreign),
// so that an error names the flag that is wrong. All of it before any file is read or written:
// a malformed flag costs milliseconds, never a run. Upper bounds are far above what fits a CPU
// budget; they are there so that no product of them overflows.
options checked_options(const flag_texts& f) {
  namespace cc = cli_checks;
  options o;
  // The device first: it decides the defaults every other flag overrides.
  const std::string device = f.given("--device") ? cc::one_of("--device", f["--device"], {"auto", "cpu", "cuda"}) : "auto";
  // Asked only when it matters: the first CUDA call loads the driver and the runtime's state.
#if MEMBOUND_EXAMPLE_CUDA
  const auto cuda_module_error = [] { return cuda_half().error; };
  const bool cuda_built = true;
  const bool gpu = device != "cpu" && cuda_device_present();
#else
  const auto cuda_module_error = [] { return std::string{}; };
  const bool cuda_built = false;
  const bool gpu = false;
#endif
  if (device == "cuda" && !gpu) {
    throw mb::invalid_argument("--device", "a device this build can use", "cuda",
                               cuda_built ? (cuda_module_error().empty()
                                                 ? "No CUDA device is visible (cudaGetDeviceCount): run on a machine "
                                                   "with a GPU, or pass --device cpu"
                                                 : "The GPU half could not be loaded (" + cuda_module_error() +
                                                       "): keep libtrain_cuda.so next to train, or pass --device cpu")
                                          : "This build has no CUDA (nvcc was not found at configure time): configure "
                                            "with nvcc on PATH or at /usr/local/cuda, or pass --device cpu");
  }
  // auto picks the CPU for --offload activations|all: activation offload runs on the CPU backend
  // so far (optimizer offload on both).
  const bool offloads_activations =
      f.given("--offload") && (f["--offload"] == "activations" || f["--offload"] == "all");
  o.device = device == "auto" ? (gpu && !offloads_activations ? "cuda" : "cpu") : device;
  if (o.device == "cuda") apply_device_defaults(o);
  const auto whole = [&](const char* flag, auto& to, std::uint64_t lo, std::uint64_t hi,
                         const std::string& bound = {}) {
    if (!f.given(flag)) return;
    using T = std::remove_reference_t<decltype(to)>;
    to = static_cast<T>(cc::whole(flag, f[flag], lo, hi, flag + (" " + std::to_string(to)), bound));
  };
  const auto real = [&](const char* flag, double& to, double lo, double hi, bool lo_open) {
    char example[64];
    std::snprintf(example, sizeof example, "%s %g", flag, to);
    if (f.given(flag)) to = cc::real(flag, f[flag], lo, hi, lo_open, example);
  };
  if (f.given("--precision")) o.precision = cc::one_of("--precision", f["--precision"], {"fp32", "bf16", "fp16"});
  if (f.given("--optimizer")) o.optimizer = cc::one_of("--optimizer", f["--optimizer"], {"adamw", "adamw8bit"});
  if (f.given("--offload")) {
    o.offload = cc::one_of("--offload", f["--offload"], {"none", "auto", "optimizer", "activations", "all"});
    if ((o.offload == "activations" || o.offload == "all") && o.device == "cuda") {
      throw mb::invalid_argument("--offload", "none, auto or optimizer with --device cuda (activation offload runs "
                                 "on the CPU backend so far)", o.offload,
                                 "Use --offload optimizer on the GPU, or --device cpu or auto");
    }
  }
  if (f.given("--host-budget")) {
    if (o.offload == "none") {
      throw mb::invalid_argument("--host-budget", "only with --offload auto, optimizer, activations or all", f["--host-budget"],
                                 "Add --offload auto, or leave --host-budget out");
    }
    o.host_budget = cc::size("--host-budget", f["--host-budget"], "--host-budget 1GiB");
  }
  if (f.given("--attention-kernels")) {
    o.attention_kernels = cc::one_of("--attention-kernels", f["--attention-kernels"], {"wmma", "mma", "cudnn", "cudnn-atomic"});
    if (o.device != "cuda") {
      throw mb::invalid_argument("--attention-kernels", "only with --device cuda (the CPU has one attention kernel)",
                                 o.attention_kernels, "Leave the flag out, or add --device cuda");
    }
  }
  whole("--threads", o.threads, 1, 256);
  whole("--zero", o.zero, 0, 3);
  whole("--overlap", o.overlap, 0, 1);
  whole("--timeout", o.timeout, 0, 86400);
  whole("--width", o.width, 1, 16384);
  whole("--heads", o.heads, 1, 1024);
  if (o.width % o.heads != 0) {
    throw mb::invalid_argument("--heads", "a divisor of --width (" + std::to_string(o.width) + ")",
                               std::to_string(o.heads),
                               "Choose --width and --heads so that width / heads is the head size");
  }
  whole("--pack", o.pack, 1, 4096);
  if (f.given("--seq") && f["--seq"] == "max") {
    if (o.device != "cuda" && o.pack == 0) {
      throw mb::invalid_argument("--seq", "a length from 1 to 2^20 on the CPU (max is for --device cuda or --pack)",
                                 "max", "Give a length, or add --device cuda, or --pack");
    }
    o.seq_max = true;  // the longest length under the emergency line (train_cuda.cu; run() below for --pack)
  } else {
    whole("--seq", o.seq, 1, 1u << 20);
  }
  whole("--batch", o.batch, 1, 1u << 16);
  if (o.pack != 0 && o.seq < 2) {
    throw mb::invalid_argument("--seq", "at least 2 tokens per packed row (--pack)", std::to_string(o.seq),
                               "e.g. --seq 256 --pack 16");
  }
  whole("--steps", o.steps, 1, 1'000'000'000);

  if (f.given("--layers")) {
    o.layers = f["--layers"];
    o.blocks.clear();
    std::size_t at = 0;
    do {  // split on ',' keeping empty names, so that "attn," and ",attn" are refused
      const std::size_t comma = std::min(o.layers.find(',', at), o.layers.size());
      const std::string name = o.layers.substr(at, comma - at);
      const std::string full = name == "ttt"        ? "ttt_linear"
                               : name == "attn"     ? "attention"
                               : name == "swa"      ? "local_attention"
                               : name == "attn_moe" ? "attention_moe"
                                                    : name;
      if (full != "ttt_linear" && full != "ttt_mlp" && full != "attention" && full != "mamba" &&
          full != "local_attention" && full != "attention_moe") {
        throw mb::invalid_argument("--layers",
                                   "a comma-separated list of ttt, ttt_mlp, attn, swa, mamba, attn_moe (no empty names)",
                                   cc::in_quotes(o.layers) + " (block " + std::to_string(o.blocks.size() + 1) + ": " +
                                       cc::in_quotes(name) + ")", "e.g. --layers ttt,attn,mamba,attn");
      }
      o.blocks.push_back(full);
      at = comma + 1;
    } while (at <= o.layers.size());
    if (o.blocks.size() > 128) {
      throw mb::invalid_argument("--layers", "at most 128 blocks", std::to_string(o.blocks.size()),
                                 "List fewer blocks");
    }
  }
  // Sliding-window blocks need their window, and a window needs a block that reads it.
  whole("--window", o.window, 1, 1u << 20);
  const bool local = std::find(o.blocks.begin(), o.blocks.end(), "local_attention") != o.blocks.end();
  if (local && o.window == 0) {
    throw mb::invalid_argument("--window", "the sliding window of the swa blocks in --layers " + cc::in_quotes(o.layers),
                               "none", "e.g. --window 64: each token attends to itself and the 63 before it");
  }
  if (!local && o.window != 0) {
    throw mb::invalid_argument("--window", "only with swa blocks in --layers", std::to_string(o.window),
                               "Add swa blocks (e.g. --layers ttt,swa,mamba,attn), or leave --window out");
  }
  // The mixture's settings need a block that reads them.
  const bool moe = std::find(o.blocks.begin(), o.blocks.end(), "attention_moe") != o.blocks.end();
  for (const char* flag : {"--experts", "--top-k", "--capacity", "--aux"}) {
    if (f.given(flag) && !moe) {
      throw mb::invalid_argument(flag, "only with attn_moe blocks in --layers", f[flag],
                                 std::string("Add attn_moe blocks (e.g. --layers ttt,attn_moe,mamba,attn_moe), or leave ") +
                                     flag + " out");
    }
  }
  whole("--experts", o.experts, 2, 256);
  whole("--top-k", o.top_k, 1, 2);
  real("--capacity", o.capacity, 0, 1e6, false);
  real("--aux", o.aux, 0, 1e3, false);
  if (f.given("--schedule")) {
    o.schedule = f["--schedule"];
    if (o.schedule != "auto") o.fixed_schedule = parse_schedule(o.schedule, o.blocks.size());
  }

  real("--lr", o.lr, 0, 1, true);
  real("--min-lr", o.min_lr, 0, o.lr, false);
  if (!f.given("--min-lr")) o.min_lr = std::min(o.min_lr, o.lr);  // the default never exceeds a small --lr
  real("--weight-decay", o.weight_decay, 0, 1, false);
  real("--clip", o.clip, 0, 1e6, false);
  // A warm-up longer than the run would never reach --lr; the default is cut to the run.
  o.warmup = std::min(o.warmup, o.steps);
  whole("--warmup", o.warmup, 0, o.steps, " (at most --steps)");
  whole("--eval-every", o.eval_every, 0, o.steps, " (0: at the end only; at most --steps)");
  whole("--eval-sequences", o.eval_sequences, 1, 4096);
  whole("--sample", o.sample, 0, 1'000'000);
  whole("--seed", o.seed, 0, UINT64_MAX);
  whole("--plan-only", o.plan_only, 0, 1);
  whole("--accept-changes", o.accept_changes, 0, 1);
  whole("--save-every", o.save_every, 0, o.steps, " (0: none; at most --steps)");
  whole("--stop-after", o.stop_after, 0, o.steps, " (0: run to --steps; at most --steps)");

  if (f.given("--budget")) {
    const std::string& b = f["--budget"];
    // A fraction of the device's memory is a bare decimal ("0.9"); sizes carry a unit or are whole.
    if (b.find('.') != std::string::npos && b.find_first_not_of("0123456789.") == std::string::npos) {
      if (o.device != "cuda") {
        throw mb::invalid_argument("--budget", "a size such as 512MiB on the CPU (a fraction is of a GPU's memory)",
                                   cc::in_quotes(b), "Give a size, or add --device cuda");
      }
      o.budget_fraction = cc::real("--budget", b, 0, 1, true, "--budget 0.9");
#if MEMBOUND_EXAMPLE_CUDA
      o.budget = static_cast<std::size_t>(o.budget_fraction * static_cast<double>(cuda_device_memory()));
#endif
    } else {
      o.budget = cc::size("--budget", b, "--budget 512MiB");
    }
  }
  if (f.given("--foreign")) {
    const std::string& s = f["--foreign"];
    const std::size_t at = s.find('@');
    if (at == std::string::npos) {
      throw mb::invalid_argument("--foreign", "SIZE@STEP, e.g. 8MiB@20", cc::in_quotes(s),
                                 "Give a size and the step it arrives at");
    }
    o.foreign.bytes = cc::size("--foreign SIZE", s.substr(0, at), "--foreign 8MiB@20");
    o.foreign.at_step =
        cc::whole("--foreign STEP", s.substr(at + 1), 1, o.steps, "--foreign 8MiB@20", " (at most --steps)");
    if (o.foreign.bytes >= o.budget) {
      throw mb::invalid_argument("--foreign", "less than the budget (" + mb::format_bytes(o.budget, false) + ")",
                                 mb::format_bytes(o.foreign.bytes, false), "Take less, or raise --budget");
    }
  }

  // Files last: inputs exist and can be read, outputs can be written, before any step is taken.
  if (f.given("--data")) o.data = f["--data"];
  cc::input_file("--data", o.data, "Pass --data FILE, a text file");
  if (f.given("--resume")) {
    o.resume = f["--resume"];
    cc::input_file("--resume", o.resume, "Pass a checkpoint written by --save-every or --stop-after");
  } else if (o.accept_changes != 0) {  // it would be silently unused
    throw mb::invalid_argument("--accept-changes", "--resume FILE with it", "no --resume",
                               "Add --resume FILE, or leave --accept-changes out");
  }
  if (f.given("--checkpoint")) {
    o.checkpoint = f["--checkpoint"];
    if (!o.saves()) {  // it would be silently unused: no checkpoint is written without them
      throw mb::invalid_argument("--checkpoint", "--save-every N or --stop-after N with it", "neither",
                                 "Add --save-every N, or leave --checkpoint out");
    }
  }
  if (o.saves()) cc::output_file("--checkpoint", o.checkpoint, /*replaced=*/true);
  if (f.given("--report")) cc::output_file("--report", o.report = f["--report"]);
  if (f.given("--trace")) cc::output_file("--trace", o.trace = f["--trace"]);
  // --plan-only trains nothing: a report or trace asked for would silently not be written.
  for (const char* out : {"--report", "--trace"}) {
    if (o.plan_only == 1 && f.given(out)) {
      throw mb::invalid_argument(out, "no " + std::string(out) + " with --plan-only 1 (nothing is trained)",
                                 f[out], "Leave " + std::string(out) + " out, or drop --plan-only");
    }
  }
  // An output over an input, or two outputs over each other, would lose one of them. --checkpoint
  // may be --resume: a resumed run goes on saving where it started.
  const std::string checkpoint = o.saves() ? o.checkpoint : "";
  cc::distinct("--checkpoint", checkpoint, "--data", o.data);
  cc::distinct("--report", o.report, "--data", o.data);
  cc::distinct("--report", o.report, "--resume", o.resume);
  cc::distinct("--report", o.report, "--checkpoint", checkpoint);
  cc::distinct("--trace", o.trace, "--data", o.data);
  cc::distinct("--trace", o.trace, "--resume", o.resume);
  cc::distinct("--trace", o.trace, "--checkpoint", checkpoint);
  cc::distinct("--trace", o.trace, "--report", o.report);
  // The environment the program reads, checked with its flags.
  (void)kill_request_from_environment();
  (void)nccl_asked_from_environment();
  return o;
}

// The text of --data as tokens (bytes); a tenth is held out for validation and the sample at the
// end starts from 32 of its bytes.
std::vector<std::int32_t> read_data(const options& o) {
  std::string s;
  try {  // libstdc++ throws from the read itself on some unreadable files
    std::ifstream in(o.data, std::ios::binary);
    if (!in) throw std::runtime_error("cannot open");
    s.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    if (in.bad()) throw std::runtime_error("read failed");
  } catch (const std::exception&) {
    throw mb::invalid_argument("--data", "a readable text file", cli_checks::in_quotes(o.data), "Pass --data FILE");
  }
  if (s.size() / 10 < std::max<std::size_t>(o.seq + 2, 33)) {
    const std::size_t least = 10 * std::max<std::size_t>(o.seq + 2, 33);
    throw mb::invalid_argument("--data",
                               "at least " + std::to_string(least) + " bytes, 10·max(--seq + 2, 33) (a tenth is held "
                               "out for validation)",
                               std::to_string(s.size()) + " bytes", "Use a longer file or a shorter --seq");
  }
  std::vector<std::int32_t> text(s.size());
  for (std::size_t i = 0; i < s.size(); ++i) text[i] = static_cast<unsigned char>(s[i]);
  return text;
}


// The ranks of this run: under an MPI launcher (mpirun sets its environment) every rank it
// started, else this process alone, without initializing MPI at all. One type either way, so the
// trainer below is one type.
class ranks {
  // Defined first: a deduced return type must be seen before its use.
  template <typename F>
  decltype(auto) call(F&& f) {
#if MEMBOUND_EXAMPLE_MPI
    if (mpi_) return f(*mpi_);
#endif
    return f(local_);
  }
  template <typename F>
  decltype(auto) call(F&& f) const {
#if MEMBOUND_EXAMPLE_MPI
    if (mpi_) return f(*mpi_);
#endif
    return f(local_);
  }
  mb::local_communicator local_;
#if MEMBOUND_EXAMPLE_MPI
  std::optional<mb::mpi_communicator> mpi_;
#endif

 public:
#if MEMBOUND_EXAMPLE_MPI
  static bool launched_by_mpi() {
    return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr ||
           std::getenv("PMIX_RANK") != nullptr;
  }
  // timeout: the most any collective may take (0: no limit); past it, collective_timeout.
  ranks(bool mpi, std::chrono::milliseconds timeout) {
    if (mpi) mpi_.emplace(MPI_COMM_WORLD, timeout);
  }
#else
  ranks(bool, std::chrono::milliseconds) {}
#endif
  std::size_t rank() const { return call([](const auto& c) { return c.rank(); }); }
  std::size_t size() const { return call([](const auto& c) { return c.size(); }); }
  const char* name() const { return call([](const auto& c) { return c.name(); }); }
  template <mb::summable T>
  std::size_t reduce_scatter_workspace_bytes(std::size_t n) const {
    return call([&](const auto& c) { return c.template reduce_scatter_workspace_bytes<T>(n); });
  }
  template <mb::summable T>
  std::size_t all_reduce_workspace_bytes(std::size_t n) const {
    return call([&](const auto& c) { return c.template all_reduce_workspace_bytes<T>(n); });
  }
  template <mb::summable T>
  std::size_t reduce_scatter_blocks_workspace_bytes(std::size_t n) const {
    return call([&](const auto& c) { return c.template reduce_scatter_blocks_workspace_bytes<T>(n); });
  }
  template <mb::summable T>
  void reduce_scatter_sum(const T* in, std::size_t n, T* out, void* ws, std::size_t bytes) {
    call([&](auto& c) { c.reduce_scatter_sum(in, n, out, ws, bytes); });
  }
  template <mb::summable T>
  void reduce_scatter_blocks_sum(const T* in, const mb::shard_range* blocks, T* out, void* ws, std::size_t bytes) {
    call([&](auto& c) { c.reduce_scatter_blocks_sum(in, blocks, out, ws, bytes); });
  }
  // A started collective: MPI's handle P in flight, or none (one process copies at once).
#if MEMBOUND_EXAMPLE_MPI
  template <typename P>
  struct started {
    P p;
    bool test() { return p.test(); }
    void wait() { p.wait(); }
  };
  using pending = started<mb::mpi_communicator::pending_reduce_scatter>;  // ZeRO-2 overlapped
  using pending_all = started<mb::mpi_communicator::pending_all_reduce>;  // ZeRO-0 overlapped
  using pending_gather = started<mb::mpi_communicator::pending_gather>;   // ZeRO-3's prefetch
#else
  struct started {
    bool test() { return true; }
    void wait() {}
  };
  using pending = started;
  using pending_all = started;
  using pending_gather = started;
#endif
  template <mb::summable T>
  pending_all start_all_reduce_sum(T* data, std::size_t n, void* ws, std::size_t bytes) {
#if MEMBOUND_EXAMPLE_MPI
    if (mpi_) return {mpi_->start_all_reduce_sum(data, n, ws, bytes)};
#endif
    local_.all_reduce_sum(data, n, ws, bytes);
    return {};
  }
  template <mb::summable T>
  pending start_reduce_scatter_blocks_sum(const T* in, const mb::shard_range* blocks, T* out, void* ws,
                                          std::size_t bytes) {
#if MEMBOUND_EXAMPLE_MPI
    if (mpi_) return {mpi_->start_reduce_scatter_blocks_sum(in, blocks, out, ws, bytes)};
#endif
    local_.reduce_scatter_blocks_sum(in, blocks, out, ws, bytes);
    return {};
  }
  template <typename T>
  void all_gather(const T* shard, T* out, std::size_t n) {
    call([&](auto& c) { c.all_gather(shard, out, n); });
  }
  // ZeRO-3's gather of a block from the ranks' shards, blocking and started (the prefetch).
  template <typename T>
  void all_gather_blocks(T* data, const mb::shard_range* blocks) {
    call([&](auto& c) { c.all_gather_blocks(data, blocks); });
  }
  template <typename T>
  pending_gather start_all_gather_blocks(T* data, const mb::shard_range* blocks) {
#if MEMBOUND_EXAMPLE_MPI
    if (mpi_) return {mpi_->start_all_gather_blocks(data, blocks)};
#endif
    local_.all_gather_blocks(data, blocks);
    return {};
  }
  template <mb::summable T>
  void all_reduce_sum(T* data, std::size_t n, void* ws, std::size_t bytes) {
    call([&](auto& c) { c.all_reduce_sum(data, n, ws, bytes); });
  }
  template <typename T>
  void broadcast(T* data, std::size_t n, std::size_t root) {
    call([&](auto& c) { c.broadcast(data, n, root); });
  }
  void barrier() {
    call([](auto& c) { c.barrier(); });
  }

};
static_assert(mb::communicator<ranks>);
static_assert(mb::overlapping_communicator<ranks>);
static_assert(mb::overlapping_all_reduce_communicator<ranks>);
static_assert(mb::prefetching_communicator<ranks>);

// Opt: the optimizer policy for P's storage (--optimizer).
template <typename P, template <typename> class Opt>
int run(const options& flags, const std::vector<std::int32_t>& text, ranks& world) {
  options o = flags;  // --seq max with --pack: the row length chosen below
  using net = mb::hybrid_model<P>;
  const net m = under_flags(o, [&] { return model_of<net>(o); });
  const std::size_t budget = o.budget;
  // Data parallel: each rank plans and runs its share of every step's sequences.
  const std::size_t N = world.size();
  if (o.batch % N != 0) {
    throw mb::invalid_argument("--batch", "a multiple of the " + std::to_string(N) + " ranks", std::to_string(o.batch),
                               "Give every rank an equal share of the sequences per step");
  }
  // ZeRO-1 over ranks: this rank plans for the optimizer state of its shard of the parameters.
  const bool sharded = o.zero >= 1 && N > 1;
  const std::size_t shard = sharded ? mb::shard_of(m.parameter_elements(), N, world.rank()).size() : 0;
  // ZeRO-2: the gradients too (each block's reduce-scattered at the end of its backward); ZeRO-3
  // the weights too (each weight unit, a block, the embedding or the head, gathered before use).
  const mb::gradient_shards grad_shards =
      mb::gradient_exchange_of<typename net::storage_type>(world, o.zero, o.overlap != 0);
  const foreign_load foreign = o.foreign;

  // The default stack: a hard budget over an expandable arena at page granularity, traced. The
  // arena commits what the step needs at the end of one reserved range and gives whole pages
  // back, so its reserve (what the budget counts and, touched, what the process holds) is what
  // the plan states: the planner replays the run's requests through a shadow of this stack.
  // Recording needs room only when a trace is asked for.
  mb::trace_recorder recorder(o.trace.empty() ? std::size_t{4096} : std::size_t{1} << 20);
  const std::size_t page = mb::host_virtual_memory::page_size();
  const std::size_t capacity = mb::align_up(std::min<std::size_t>(budget, std::size_t{1} << 40), page);
  using stack = mb::budget_allocator<mb::traced_allocator<mb::expandable_arena<mb::host_virtual_memory>>>;
  stack alloc(budget, recorder, mb::expandable_arena_options{capacity}, page);
  const mb::reserve_function reserve = mb::reserve_model(m, alloc);
  const auto fit_opts = [&] {
    mb::fit_options fo;
    fo.threads = o.threads;
    fo.reserve = reserve;
    fo.optimizer_policy = mb::optimizer_of<Opt<typename net::storage_type>>();
    fo.optimizer_elements = shard;
    fo.gradients = grad_shards;
    fo.prefer_below = emergency_line(budget);
    fo.offload = {o.offload == "auto" || o.offload == "optimizer" || o.offload == "all", 0, o.host_budget,
                  o.offload == "activations" || o.offload == "all"};
    fo.offload_mode = o.offload == "auto" ? mb::fit_options::offload_choice::when_needed
                                          : mb::fit_options::offload_choice::always;
    return fo;
  };
  // --pack with --seq max: the most tokens per packed row (a multiple of 64) that a plan fits under
  // the emergency line, or under the budget when none does (as the device run's --seq max).
  if (o.pack != 0 && o.seq_max) {
    const std::size_t most = longest_useful_row(text, o.pack);
    o.seq = under_flags(o, [&] {
      mb::fit_options fo = fit_opts();
      fo.prefer_below = 0;
      const std::size_t rows = o.batch / N;  // each rank's rows per step
      try {
        return mb::fit_tokens(m, most, o.pack, emergency_line(budget), fo, 64, rows).micro.seq;
      } catch (const mb::host_budget_too_small&) {
        return mb::fit_tokens(m, most, o.pack, budget, fo, 64, rows).micro.seq;
      } catch (const mb::budget_too_small&) {
        return mb::fit_tokens(m, most, o.pack, budget, fo, 64, rows).micro.seq;
      }
    });
    std::printf("--seq max: %zu tokens per packed row, at most %zu paragraphs each (the most that fit)\n", o.seq,
                o.pack);
  }
  // Packed (--pack): rows of --seq tokens holding at most --pack paragraphs each.
  const mb::batch_shape eff{o.batch, o.seq, o.pack};
  const mb::batch_shape share{o.batch / N, o.seq, o.pack};

  const mb::training_plan plan = under_flags(o, [&] {
    if (!o.fixed_schedule) return mb::fit(m, share, budget, fit_opts());
    mb::plan_options po;
    po.threads = o.threads;
    po.optimizer_policy = mb::optimizer_of<Opt<typename net::storage_type>>();
    po.optimizer_elements = shard;
    po.gradients = grad_shards;
    po.offload = {o.offload == "optimizer" || o.offload == "all", 0, o.host_budget,
                  o.offload == "activations" || o.offload == "all"};
    mb::training_plan p = mb::make_plan(m, share, *o.fixed_schedule, po, budget);
    p.reserved_peak = reserve(p);
    if (!p.fits() && o.offload == "auto") {  // the state beside it does not fit: on the host then
      po.offload = {true, 0, o.host_budget};
      p = mb::make_plan(m, share, *o.fixed_schedule, po, budget);
      p.reserved_peak = reserve(p);
    }
    if ((o.offload == "activations" || o.offload == "all") && o.fixed_schedule->k != mb::schedule_choice::kind::budget) {
      std::printf("--offload %s: block inputs are offloaded by budget schedules only; --schedule %s keeps them on "
                  "the device\n", o.offload.c_str(), o.fixed_schedule->name().c_str());
    }
    if (!p.device_fits()) throw mb::budget_too_small(budget, p.budgeted_peak());
    if (!p.host_fits()) throw mb::host_budget_too_small(o.host_budget, p.host_peak(), budget);
    return p;
  });
  std::printf("model: %zu blocks (%s), width %zu, %zu heads, %s, %zu parameters\n", m.depth(), o.layers.c_str(),
              o.width, o.heads, o.precision.c_str(), m.parameter_count());
  std::printf("%s\n", plan.table().c_str());
  if (N > 1) {
    std::printf("data parallel: %zu ranks (%s), %zu of the %zu sequences per step each; %s; the plan above is rank "
                "0's, each rank's line follows\n",
                N, world.name(), share.batch, o.batch,
                o.zero == 3 ? "each rank holds its shard of the weights, gradients and optimizer state and gathers each "
                              "block's weights as it runs (ZeRO-3)"
                : o.zero == 2 ? "each rank holds the whole model and its shard of the gradients and optimizer state (ZeRO-2)"
                : sharded   ? "each rank holds the whole model and its shard of the optimizer state (ZeRO-1)"
                            : "every rank holds the whole model and optimizer state (ZeRO-0)");
  }
  if (o.plan_only == 1) {
    // The trainer is not made, so no checkpoint is read: a plan it holds (a pressure replan's)
    // would replace this one when it fits.
    if (!o.resume.empty()) std::printf("--resume: not read with --plan-only; its own plan replaces this one if it fits\n");
    return 0;  // the plan is what was asked for: nothing trained
  }

  mb::thread_pool pool(o.threads);
  const mb::pressure_thresholds thresholds{};
  const std::size_t split = text.size() * 9 / 10;
  const std::vector<std::int32_t> train(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(split));
  const std::vector<std::int32_t> val(text.begin() + static_cast<std::ptrdiff_t>(split), text.end());
  // The process's baseline: everything but the trainer's memory exists now (code, data, pool,
  // the arena's empty range). The peak from here on is compared with the plan's reserve.
  mb::reset_peak_rss();
  const mb::process_memory_info baseline = mb::process_memory();

  mb::trainer_options to = trainer_options_of(o, text);
  to.overlap = o.overlap != 0 && N > 1;
  // The host space of --offload: a budget over the system's heap (--host-budget; none: unbounded,
  // measured all the same).
  mb::budget_allocator<mb::system_allocator> host_space(o.host_budget != 0 ? o.host_budget : SIZE_MAX);
  to.host = mb::host_allocator_ref(host_space);
  using monitor = mb::pressure_monitor<mb::all_check_points>;
  mb::trainer<net, stack, monitor, ranks, Opt<typename net::storage_type>> t(m, eff, plan, alloc, pool, to,
                                                                            monitor(thresholds), world);
  const bool writer = world.rank() == 0;  // files are written by rank 0 only (every rank holds the same state)
  // ZeRO-1 checkpoints are a collective: every rank writes its shard, rank 0 the manifest.
  const bool saver = writer || sharded;
  if (N > 1) {
    // Every rank's bytes (a collective): rank 0 prints them.
    std::printf("%s\n", mb::rank_memory_table(t.memory_of_ranks()).c_str());
  }
  t.monitor().attach(recorder);
  // Checked here too, before any step: the trainer now holds all its own bytes between steps.
  if (foreign.bytes > alloc.headroom()) {
    throw mb::invalid_argument("--foreign", "at most the budget's headroom between steps, " +
                                                mb::format_bytes(alloc.headroom(), false),
                               mb::format_bytes(foreign.bytes, false), "Take less, or raise --budget");
  }
  resume_from(t, o);

  // The steps over either kind of source: random windows of the text, or packed rows of its
  // paragraphs (--pack).
  const auto train_with = [&](auto& train_src, auto& val_src) -> int {
    auto eval = [&] { return t.evaluate(val_src, o.eval_sequences, o.seed); };

    progress bar(o.steps);
    const double first_eval = eval();
    bar.note(eval_line(t.steps_done(), o, first_eval));
    double last_loss = 0, last_eval = first_eval, total_ms = 0;
    std::size_t tokens_done = 0, skipped = 0, replans = 0;
    mb::moe_stats moe_total{};  // the mixture blocks' counts over the run (the report's "moe")
    std::uint64_t last_eval_step = 0;  // the step of the last evaluation in the loop
    const std::uint64_t stop = o.stop_after == 0 ? o.steps : std::min<std::uint64_t>(o.steps, t.steps_done() + o.stop_after);
    bool foreign_taken = false;
    // The report and the trace: after the run, and also for the steps that ran when an error ends
    // it (no plan fits beside memory taken by others, another rank failed), so that what led to the
    // error is kept.
    const auto write_files = [&](const char* stopped_by) {
      if (!writer) return;
      if (!o.report.empty()) {
        const mb::training_plan& p = t.plan();
        const auto st = alloc.stats();
        const std::size_t predicted = t.largest_predicted_peak();
        const std::size_t predicted_reserve = t.largest_predicted_reserve();
        const mb::process_memory_info rss = mb::process_memory();
        nlohmann::json j;
        j["budget_bytes"] = budget;
        j["predicted_peak_bytes"] = predicted;
        j["measured_peak_bytes"] = st.peak_requested;
        j["predicted_reserved_peak_bytes"] = predicted_reserve;
        j["measured_reserved_peak_bytes"] = st.peak_reserved;
        // What `top` sees: the process before the trainer existed, and its peak since then.
        j["baseline_rss_bytes"] = baseline.known ? baseline.rss : 0;
        j["peak_rss_bytes"] = rss.known ? rss.peak_rss : 0;
        // A sanitizer's shadow memory and quarantine are in the RSS too: the figure is not the plan's.
  #if defined(__SANITIZE_ADDRESS__)
        j["address_sanitizer"] = true;
  #else
        j["address_sanitizer"] = false;
  #endif
        add_run_fields(j,
                       {first_eval, last_eval, last_loss, total_ms, tokens_done, skipped, replans, last_eval_step,
                        moe_total},
                       t.steps_done(), stopped_by);
        j["foreign_bytes"] = alloc.external();
        j["loss_scale"] = t.loss_scaling_on() ? t.scaler().scale : 1.0;
        j["thresholds"] = {{"warning", thresholds.warning}, {"critical", thresholds.critical},
                           {"emergency", thresholds.emergency}};
        j["host"] = {{"offload_optimizer", p.offload_optimizer},
                     {"activations_bytes", p.host_activations},
                     {"offloaded_bytes_per_micro_batch", p.offloaded_bytes},
                     {"predicted_peak_bytes", t.largest_predicted_host_peak()},
                     {"measured_peak_bytes", host_space.stats().peak_requested},
                     {"budget_bytes", o.host_budget}};
        j["plan"] = {{"weights", p.weights},       {"gradients", p.gradients},
                     {"optimizer", p.optimizer},   {"activations", p.activations},
                     {"workspace", p.workspace},   {"peak", p.peak_bytes},
                     {"reserved_peak", p.reserved_peak},
                     {"peak_phase", p.peak_phase}, {"micro_batch", p.micro.batch},
                     {"accumulation", p.accumulation}, {"schedule", p.schedule.name()}};
        j["policies"] = {{"precision", o.precision}, {"schedule", p.schedule.name()},
                         {"head_chunk", p.head_chunk}, {"layers", o.layers}, {"threads", o.threads},
                         {"loss_scaling", t.loss_scaling_on()}, {"allocator", "budget<traced<expandable_arena<host_virtual_memory>>>, " + std::to_string(page) + " B granules"},
                         {"monitor", "pressure_monitor<all_check_points>"}};
        cli_checks::write_file("--report", o.report, [&](std::ostream& os) { os << j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n"; });
      }
      if (!o.trace.empty()) {
        cli_checks::write_file("--trace", o.trace, [&](std::ostream& os) { recorder.write_chrome_trace(os); });
      }
    };
    try {
      while (t.steps_done() < stop) {
        // ">=": a run resumed past STEP takes the bytes at once, as the uninterrupted run held them.
        if (foreign.bytes != 0 && !foreign_taken && t.steps_done() + 1 >= foreign.at_step) {
          foreign_taken = true;
          // What the arena holds beyond live blocks is nobody's: others can take it.
          alloc.release_cached();
          if (foreign.bytes > alloc.headroom()) {
            throw mb::invalid_argument("--foreign", "at most the budget's headroom between steps, " +
                                                        mb::format_bytes(alloc.headroom(), false),
                                       mb::format_bytes(foreign.bytes, false), "Take less, or raise --budget");
          }
          alloc.set_external(foreign.bytes);
          // In the trace as tag "other", so that a plot shows what the budget is shared with.
          recorder.record_allocation(mb::memory_tag::other, foreign.bytes, nullptr);
          bar.note("step " + std::to_string(t.steps_done() + 1) + ": " + mb::format_bytes(foreign.bytes, false) +
                   " of the budget are now held by something else (--foreign)");
        }
        const mb::step_result r = t.step(train_src);
        for (const mb::replan_event& e : r.replans) {
          bar.note(e.describe());
          ++replans;
        }
        total_ms += r.ms;
        tokens_done += r.tokens;
        moe_total += r.moe;
        last_loss = r.loss;
        skipped += r.applied ? 0 : 1;
        const auto st = alloc.stats();
        bar.step(r, alloc.usage(), st.peak_requested, budget);
        if (o.eval_every != 0 && r.step % o.eval_every == 0) {
          last_eval = eval();
          last_eval_step = r.step;
          bar.note(eval_line(r.step, o, last_eval));
        }
        // --stop-after always saves where it stops, so that --resume can continue.
        if (saver) save_if_due(t, o, r.step, stop, bar);
        kill_if_asked(world.rank(), r.step);
      }
    } catch (const std::exception&) {
      bar.finish();
      // The error as the command line names it (no plan fits any more: --budget, and --foreign
      // when its bytes were taken), in the report too.
      try {
        rethrow_mid_run(o, budget, foreign_taken);
      } catch (const std::exception& named) {
        try {
          write_files(named.what());
        } catch (const std::exception& w) {
          // The run's own error is the one to report; the files' is said beside it.
          std::fprintf(stderr, "train: the report or trace of the steps that ran was not written: %s\n", w.what());
        }
        throw;
      }
    }
    bar.finish();
    if (o.eval_every == 0 || t.steps_done() % o.eval_every != 0) last_eval = eval();

    // The samples' requests are not part of the plan: give the free tail back first, so they take
    // fresh pages below the training peak.
    alloc.release_cached();
    if (o.sample > 0) {
      // One sequence of at most o.seq tokens; under ZeRO-3 every rank gathers each block per token.
      const std::string out = t.decode(1, o.seq, [&](auto& d) { return sample_text(val, o, d); });
      std::printf("\nsample:\n%s\n\n", out.c_str());
    }

    const auto st = alloc.stats();
    const std::size_t predicted = t.largest_predicted_peak();
    const std::size_t predicted_reserve = t.largest_predicted_reserve();
    const mb::process_memory_info rss = mb::process_memory();
    const bool requested_ok = st.peak_requested <= predicted && predicted <= budget;
    const bool reserve_ok = st.peak_reserved <= predicted_reserve && predicted_reserve <= budget;
    std::printf("eval loss %.4f -> %.4f; measured peak %.2f MiB <= predicted %.2f MiB <= budget %.2f MiB: %s\n",
                first_eval, last_eval, mib(st.peak_requested), mib(predicted), mib(budget), requested_ok ? "yes" : "NO");
    std::printf("reserved by the arena: measured %.2f MiB <= predicted %.2f MiB: %s", mib(st.peak_reserved),
                mib(predicted_reserve), reserve_ok ? "yes" : "NO");
    // Every plan it ran under (a replan may change the offloaded inputs) stays within the largest.
    const std::size_t host_predicted = t.largest_predicted_host_peak();
    const bool host_ok = host_space.stats().peak_requested <= host_predicted;
    const std::string host_line =
        host_space_line(host_space.stats().peak_requested, host_predicted, o.host_budget, "--offload");
    if (!host_line.empty()) std::printf("\n%s", host_line.c_str());
    if (rss.known && baseline.known) {
      // Beyond the baseline and the reserve: thread stacks and the heap's own bookkeeping.
      // The host space (--offload) is the process's memory too.
      const std::size_t host = host_predicted;
      const double other = mib(rss.peak_rss) - mib(baseline.rss) - mib(predicted_reserve) - mib(host);
      char host_part[64] = "";
      if (host != 0) std::snprintf(host_part, sizeof host_part, " + host space %.2f MiB", mib(host));
      std::printf("\nprocess peak RSS %.2f MiB = baseline %.2f MiB + predicted reserve %.2f MiB%s %c %.2f MiB other",
                  mib(rss.peak_rss), mib(baseline.rss), mib(predicted_reserve), host_part, other < 0 ? '-' : '+',
                  std::abs(other));
    }
    std::printf("\n");
    write_files(nullptr);
    return requested_ok && reserve_ok && host_ok ? 0 : 3;
  };
  if (o.pack == 0) {
    windows train_src{&train, o.seq}, val_src{&val, o.seq};
    return train_with(train_src, val_src);
  }
  const packed_corpus corpus(train, val, o.seq, o.pack);
  packed_rows train_src = corpus.train_source(), val_src = corpus.val_source();
  return train_with(train_src, val_src);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"membound example trainer: a byte-level hybrid language model inside a memory budget"};
  flag_texts f;
  f.app = &app;
  const auto flag = [&](const std::string& name, const std::string& type, const std::string& help) {
    app.add_option(name, f.text[name], help)->type_name(type);
  };
  flag("--device", "auto|cpu|cuda",
       "where to train: auto is cuda when this build has CUDA and a GPU is visible, else cpu; on cuda the defaults "
       "are 12 blocks of width 768 (ttt,attn,mamba,attn three times), 12 heads, --seq 2048, --batch 8, bf16, "
       "--budget 8GiB, --eval-sequences 8; over several mpirun ranks cuda runs one GPU per rank over NCCL "
       "(libtrain_cuda_nccl.so, --zero 0 or 1) (default auto)");
  flag("--data", "FILE", "text file to train on (default: tiny-shakespeare)");
  flag("--budget", "SIZE",
       "memory budget: a whole number of bytes with an optional unit B, KiB, MiB, GiB, TiB, KB, MB, GB, TB, no space, "
       "or on cuda a fraction of the device's memory such as 0.9 (default 32MiB; 8GiB on cuda)");
  flag("--layers", "LIST",
       "block pattern: ttt, ttt_mlp, attn, swa, mamba, attn_moe (attention with a mixture of experts), "
       "comma-separated (default ttt,attn,mamba,attn)");
  flag("--window", "1..2^20", "swa blocks' sliding window: each token attends to itself and the W - 1 before it");
  flag("--experts", "2..256", "attn_moe blocks' experts (default 8), each a SwiGLU of the MLP's width");
  flag("--top-k", "1..2", "experts per token (default 2; 1: Switch, the gate is the router's probability)");
  flag("--capacity", "[0,10^6]", "slots per expert, floor(F * tokens * k / experts); 0: no limit (default 1.25)");
  flag("--aux", "[0,10^3]", "weight of the load-balancing loss added to the loss (default 0.01)");
  flag("--width", "1..16384", "model width (default 128)");
  flag("--heads", "1..1024", "attention and TTT heads, a divisor of --width (default 4)");
  flag("--seq", "1..2^20|max",
       "sequence length (default 128; 2048 on cuda); on cuda, max trains at the largest multiple of 256 that the "
       "planner fits with --batch sequences under the pressure monitor's emergency line (97% of --budget, less what "
       "the device holds outside the stack), or under --budget when none fits there; with --pack, max is the largest "
       "multiple of 64 tokens per packed row that fits the same way");
  flag("--batch", "1..65536", "sequences per optimizer step, or with --pack packed rows (default 8)");
  flag("--pack", "1..4096",
       "train on whole paragraphs (runs of lines between blank lines) packed into rows of --seq tokens, at most this "
       "many per row, instead of random windows: no padding beyond each row's end, no paragraph cut unless longer "
       "than a row; with --seq max the row is the longest that fits --budget (CPU only)");
  flag("--steps", "1..10^9", "optimizer steps (default 200)");
  flag("--precision", "fp32|bf16|fp16", "storage precision; fp16 turns on dynamic loss scaling (default fp32)");
  flag("--schedule", "SCHEDULE",
       "auto (the planner's fit), none, full, every:K, binomial:S with K, S from 1 to the number of blocks "
       "(default auto)");
  flag("--threads", "1..256", "CPU threads (default 2)");
  flag("--zero", "0|1|2|3",
       "ZeRO stage under mpirun: 1 shards AdamW's state and the checkpoints over the ranks (each rank writes its "
       "shard and rank 0 a manifest at --checkpoint), 2 the gradients too, 3 the weights too, each block's, "
       "the embedding's and the head's gathered around their use (2 and 3: CPU ranks only); with one process 1, 2 and 3 are the same as 0 (default 0)");
  flag("--overlap", "0|1",
       "under mpirun, 1 starts each block's gradient exchange as its backward ends and completes it after the next "
       "block's, which runs meanwhile: with --zero 2 or 3 every micro-batch's reduce-scatter of the block (one bucket and "
       "its workspace more in flight), with --zero 0 or 1 the last micro-batch's all-reduce or reduce-scatter of the "
       "block's accumulated gradients (one workspace more in flight); with --zero 3 also the gather of the weights "
       "the next op reads started as the op before it begins (a second slot); the same sums, planned; CPU ranks only; "
       "refused in one process, which exchanges nothing (default 0)");
  flag("--timeout", "0..86400",
       "under mpirun, the most seconds any collective may take (on GPU ranks from its enqueue, NCCL's watchdog): a "
       "rank that died or hangs makes the others stop with collective_timeout after this long (0: wait as long as "
       "it takes, default)");
  flag("--lr", "(0,1]", "peak learning rate (default 0.003)");
  flag("--min-lr", "[0,lr]", "learning rate at the end of the cosine (default 0.0003, at most --lr)");
  flag("--weight-decay", "[0,1]", "AdamW's decoupled weight decay (default 0.1)");
  flag("--optimizer", "adamw|adamw8bit", "AdamW with fp32 m, v, or with 8-bit block-wise m, v (default adamw)");
  flag("--offload", "none|auto|optimizer|activations|all",
       "optimizer: keep the optimizer's state (AdamW's m, v, fp32 masters) in a host space beside --budget, updated "
       "there bucket by bucket (the same bits); auto: only when no plan fits --budget with the state in it; "
       "activations: a budget schedule may keep block inputs there instead of recomputing (copied out in forward, "
       "back before their backward); all: both; the plan table gives both spaces' bytes (on cuda the host space is "
       "pinned memory and activations/all are refused: their device path is not built; default none)");
  flag("--host-budget", "SIZE", "with --offload, the host space's budget, e.g. 1GiB (default: none, measured)");
  flag("--attention-kernels", "mma|wmma|cudnn|cudnn-atomic",
       "on cuda with bf16 storage and head size <= 128: mma runs the mma.sync forward and backward with fragments "
       "in registers (sm_80 and up; elsewhere wmma runs); wmma the first kernels (a WMMA forward, a SIMT backward); "
       "cudnn cuDNN's fused flash attention where the build has it and libcudnn.so.9 loads, else mma, with its "
       "deterministic backward; cudnn-atomic with its faster atomic one (repeats differ in the last bits; both never "
       "run on a GPU yet); fp32 and larger heads always run the SIMT kernels; the first lines say which ran (default mma)");
  flag("--clip", "[0,10^6]", "global gradient-norm clip, 0: off (default 1)");
  flag("--warmup", "0..steps", "warm-up steps, at most --steps (default 30, or --steps if fewer)");
  flag("--eval-every", "0..steps", "steps between validation losses, 0: at the end only (default 50)");
  flag("--eval-sequences", "1..4096", "validation sequences per evaluation (default 32)");
  flag("--sample", "0..10^6", "characters to sample at the end (default 200)");
  flag("--seed", "0..2^64-1", "random seed (default 1)");
  flag("--save-every", "0..steps",
       "steps between checkpoints to --checkpoint, and one after the last step; 0: none (default 0)");
  flag("--checkpoint", "FILE", "where --save-every and --stop-after write (default train.ckpt)");
  flag("--resume", "FILE",
       "checkpoint to resume from; the run goes on bit for bit when the flags are the ones it was written with, and "
       "flags that change the run from there (--lr, --min-lr, --warmup, --steps, --weight-decay, --clip, --data, "
       "--seed) are refused by name");
  flag("--accept-changes", "0|1",
       "1: with --resume, go on under flags that change the run (a longer --steps, a lower --lr), naming what "
       "changed; 0: refuse them (default 0)");
  flag("--stop-after", "0..steps",
       "stop after this many steps of this invocation, saving to --checkpoint (the schedule still spans --steps; "
       "--resume it later)");
  flag("--report", "FILE", "write a JSON report here (its folder must exist)");
  flag("--trace", "FILE", "write the Chrome trace of memory by tag here (plot it with plot_memory)");
  flag("--foreign", "SIZE@STEP", "something else takes SIZE of the budget from STEP (1..steps) on");
  flag("--plan-only", "0|1",
       "1: print the plan (on cuda with --seq max, the length it chose) and exit before the first step; 0: train "
       "(default 0)");
  // A flag given twice is refused by name (CLI11 would say only "At Most 1 required but received 2").
  std::map<std::string, int> seen;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (!a.starts_with("--") || a == "--") continue;
    const std::string name = a.substr(0, a.find('='));
    if (f.text.count(name) != 0 && ++seen[name] == 2) {
      std::fprintf(stderr, "error: invalid argument '%s': expected it at most once, got it twice or more. Give each "
                           "flag once (see --help)\n", name.c_str());
      return 1;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::fprintf(stderr, "error: %s (see --help)\n", cli_checks::one_line(e.what()).c_str());
    return 1;
  }
  try {
    const options o = checked_options(f);
    const std::vector<std::int32_t> text = read_data(o);
#if MEMBOUND_EXAMPLE_MPI
    std::optional<mb::mpi_environment> mpi;
    if (ranks::launched_by_mpi()) mpi.emplace(argc, argv);
    ranks world(mpi.has_value(), std::chrono::seconds(o.timeout));
#else
    ranks world(false, std::chrono::seconds(o.timeout));
#endif
    // Rank 0 prints; the others' lines would repeat it (errors still reach stderr from every rank).
    if (world.rank() != 0 && std::freopen("/dev/null", "w", stdout) == nullptr) return 1;
    try {
      if (o.overlap != 0 && world.size() == 1) {
        throw mb::invalid_argument("--overlap", "0 in one process (there is no gradient exchange to overlap)", "1",
                                   "Run under mpirun -np N with N > 1, or leave --overlap out");
      }
#if MEMBOUND_EXAMPLE_CUDA
      if (o.device == "cuda") {
        // Over several ranks, or when MEMBOUND_EXAMPLE_NCCL=1 asks for it: a GPU per rank over NCCL
        // (libtrain_cuda_nccl.so); else one GPU (mpirun -np 1 included: no NCCL needed for it).
        const bool over_ranks = world.size() > 1 || nccl_asked_from_environment();
        return over_ranks ? run_on_device_ranks(o, text) : run_on_device(o, text);
      }
#endif
      // adamw8bit's default block (2048), named by a one-parameter template.
      const auto with = [&]<template <typename> class Opt>() {
        if (o.precision == "bf16") return run<mb::bf16_precision, Opt>(o, text, world);
        if (o.precision == "fp16") return run<mb::fp16_precision, Opt>(o, text, world);
        return run<mb::fp32_precision, Opt>(o, text, world);
      };
      if (o.optimizer == "adamw8bit") return with.template operator()<adamw8bit_2048>();
      return with.template operator()<mb::adamw>();
    } catch (const std::exception& e) {
#if MEMBOUND_EXAMPLE_MPI
      // The other ranks may be waiting in a collective this rank will never join: end them all
      // (a normal exit would finalize MPI, which can wait on them forever).
      if (world.size() > 1) {
        std::fflush(stdout);
        std::fprintf(stderr, "error: rank %zu: %s\n", world.rank(), cli_checks::one_line(e.what()).c_str());
        let_failing_rank_speak(e);
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
#endif
      throw;
    }
  } catch (const std::exception& e) {
    // Under mpirun every rank that fails says so, named (the flags are the same on every rank,
    // but a file or a device may not be).
    const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
    if (rank == nullptr) rank = std::getenv("PMIX_RANK");
    std::fflush(stdout);  // what was printed comes first, and the error on a line of its own
    if (rank != nullptr) std::fprintf(stderr, "error: rank %s: %s\n", rank, cli_checks::one_line(e.what()).c_str());
    else std::fprintf(stderr, "error: %s\n", cli_checks::one_line(e.what()).c_str());
    return 1;
  }
}
