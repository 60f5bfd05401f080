// memory_tour: membound's memory core at work on a simulated training loop.
//
// A small "model" (weights, gradients, Adam state) trains inside a hard budget while its sequence
// length grows. Every byte goes through one allocator stack, budget<traced<caching<system>>>:
//   - the budget refuses what would cross the limit, with a typed out_of_memory that says why;
//   - the caching allocator makes repeated steps free of upstream calls;
//   - the trace recorder writes a Chrome/Perfetto trace of every allocation and pressure change;
//   - the pressure monitor, checked after forward and after backward, asks for a stricter plan.
// The "stricter plan" here is halving the micro-batch; the real trainer swaps checkpoint plans.
//
//   memory_tour [--budget-mib N] [--steps N] [--trace FILE]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "cli_checks.hpp"
#include "membound/membound.hpp"

namespace mb = membound;
using mb::memory_tag;

namespace {

struct options {
  std::size_t budget_mib = 160;
  int steps = 9;
  std::string trace_path = "memory_tour_trace.json";
};

// Numbers by the strict rules of cli_checks.hpp; the trace's folder is checked before the tour.
options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--help" || a == "-h") {
      std::printf("memory_tour: one model's buffers through the allocator stack, step by step, with a trace\n"
                  "  --budget-mib N  the budget in MiB, 1..2^20 (default 160)\n"
                  "  --steps N       training steps, 1..10000 (default 9)\n"
                  "  --trace FILE    where the trace goes (default memory_tour_trace.json)\n");
      std::exit(0);
    }
    if (a == "--budget-mib" && has_value) {
      o.budget_mib = cli_checks::whole(a, argv[++i], 1, std::size_t{1} << 20, "--budget-mib 160");
    } else if (a == "--steps" && has_value) {
      o.steps = static_cast<int>(cli_checks::whole(a, argv[++i], 1, 10000, "--steps 9"));
    } else if (a == "--trace" && has_value) {
      o.trace_path = argv[++i];
    } else {
      throw mb::invalid_argument(std::string(a), "--budget-mib N, --steps N or --trace FILE, each with a value",
                                 "", "Run with no arguments for the defaults");
    }
  }
  cli_checks::output_file("--trace", o.trace_path);
  return o;
}

// Model sizes: 4 layers of width 256 and a 256-token vocabulary, in fp32.
constexpr std::size_t layers = 4, width = 256, vocab = 256, f32 = sizeof(float);
constexpr std::size_t al = mb::default_alignment;

using memory_stack = mb::budget_allocator<mb::traced_allocator<mb::caching_allocator<mb::system_allocator>>>;

struct buffer {
  void* p;
  std::size_t n;
  memory_tag tag;
};

// Activations and scratch of one step. Freed in reverse, including when forward throws half-way,
// so an out-of-memory leaves the allocator exactly as it was before the step.
class step_memory {
 public:
  explicit step_memory(memory_stack& a) : a_(a) {}
  step_memory(const step_memory&) = delete;
  step_memory& operator=(const step_memory&) = delete;
  ~step_memory() { release_all(); }
  void* take(std::size_t n, memory_tag t) {
    void* p = a_.allocate(n, al, t);
    live_.push_back({p, n, t});
    return p;
  }
  void release_last() {
    a_.deallocate(live_.back().p, live_.back().n, al, live_.back().tag);
    live_.pop_back();
  }
  void release_all() {
    while (!live_.empty()) release_last();
  }
  std::size_t count() const { return live_.size(); }

 private:
  memory_stack& a_;
  std::vector<buffer> live_;
};

// Per layer: norm out, q/k/v, attention out, MLP hidden (4x), residual; attention scratch is
// carved from one workspace whose tiles share bytes (they are never live at once).
void forward(step_memory& mem, std::size_t batch, std::size_t seq) {
  const std::size_t tok = batch * seq;
  constexpr std::size_t tile = 64;
  mb::workspace_layout<3> ws;
  const std::size_t scores = ws.add(tile * tile * f32, al, {0, 0});  // phase 0: scores
  const std::size_t probs = ws.add(tile * tile * f32, al, {1, 1});   // phase 1: probabilities
  ws.add(tile * width * f32, al, {0, 1});                            // both: accumulator
  for (std::size_t l = 0; l < layers; ++l) {
    mem.take(tok * width * f32, memory_tag::activations);
    mem.take(3 * tok * width * f32, memory_tag::activations);
    void* scratch = mem.take(ws.size(), memory_tag::workspace);
    const mb::workspace_view view = mb::carve(ws, scratch, ws.size());
    view.get<float>(scores)[0] = view.get<float>(probs)[0] = 0.0f;  // shares bytes: same address
    mem.release_last();
    mem.take(tok * width * f32, memory_tag::activations);
    mem.take(4 * tok * width * f32, memory_tag::activations);
    mem.take(tok * width * f32, memory_tag::activations);
  }
}

void backward(step_memory& mem) {
  while (mem.count() > 0) mem.release_last();
}

}  // namespace

int main(int argc, char** argv) try {
  const options opt = parse(argc, argv);
  mb::trace_recorder recorder(1 << 16);
  memory_stack memory(opt.budget_mib << 20, recorder);
  mb::pressure_monitor<mb::peak_check_points> monitor;
  monitor.attach(recorder);
  // The monitor returns the level after its actions ran (releasing the cache may lower it), so
  // the worst level a step entered is collected from the callback.
  mb::pressure_level worst = mb::pressure_level::normal;
  for (mb::pressure_level l : {mb::pressure_level::warning, mb::pressure_level::critical,
                               mb::pressure_level::emergency}) {
    monitor.actions(l).callback = [&worst](const mb::pressure_event& e) {
      worst = std::max(worst, e.current);
      std::printf("  ! pressure %s at %s: %.1f%% of the budget\n", std::string(to_string(e.current)).c_str(),
                  std::string(to_string(e.point)).c_str(),
                  100.0 * static_cast<double>(e.usage) / static_cast<double>(e.limit));
    };
  }

  std::printf("membound memory tour: a simulated training loop inside a hard budget\n");
  std::printf("  allocator stack : budget<traced<caching<system>>>\n");
  std::printf("  budget          : %s\n", mb::format_bytes(memory.limit()).c_str());
  std::printf("  model           : %zu layers, width %zu, vocabulary %zu, fp32\n\n", layers, width, vocab);

  // Long-lived state: weights, gradients and Adam's two moments, tagged so the budget can say
  // which policy to change when it refuses a request.
  std::vector<buffer> persistent;
  const std::size_t per_layer = 12 * width * width * f32 + 2 * width * f32;
  const std::size_t embedding = vocab * width * f32;
  for (memory_tag t : {memory_tag::weights, memory_tag::gradients, memory_tag::optimizer, memory_tag::optimizer}) {
    persistent.push_back({memory.allocate(embedding, al, t), embedding, t});
    for (std::size_t l = 0; l < layers; ++l) persistent.push_back({memory.allocate(per_layer, al, t), per_layer, t});
  }

  std::printf("%4s %6s %6s  %-15s %-15s %9s %6s  %s\n", "step", "batch", "seq", "peak requested",
              "peak reserved", "upstream", "frag", "worst pressure");
  std::size_t batch = 8, run_peak_reserved = 0;
  for (int step = 1; step <= opt.steps; ++step) {
    // A curriculum that doubles the context every 3 steps.
    const std::size_t seq = std::size_t{128} << std::min((step - 1) / 3, 8);
    memory.reset_peaks();
    const auto calls_before = memory.stats().upstream_calls();
    worst = mb::pressure_level::normal;
    try {
      step_memory mem(memory);
      forward(mem, batch, seq);
      monitor.check<mb::check_point::after_forward>(memory);
      backward(mem);
      monitor.check<mb::check_point::after_backward>(memory);
    } catch (const mb::out_of_memory& e) {
      std::printf("  step %d does not fit; the budget says:\n%s\n", step, e.what());
      std::printf("  -> retrying the step with half the micro-batch (state is intact: %s requested)\n",
                  mb::format_bytes(memory.stats().requested).c_str());
      batch /= 2;
      --step;
      if (batch == 0) return 1;
      continue;
    }
    const mb::memory_stats s = memory.stats();
    run_peak_reserved = std::max(run_peak_reserved, s.peak_reserved);
    std::printf("%4d %6zu %6zu  %-15s %-15s %9llu %6.3f  %s\n", step, batch, seq,
                mb::format_bytes(s.peak_requested, false).c_str(),
                mb::format_bytes(s.peak_reserved, false).c_str(),
                static_cast<unsigned long long>(s.upstream_calls() - calls_before), s.fragmentation(),
                std::string(to_string(worst)).c_str());
    if (monitor.stricter_plan_requested()) {
      std::printf("  -> the monitor asks for a stricter plan: halving the micro-batch\n");
      batch = batch > 1 ? batch / 2 : 1;
      monitor.clear_stricter_plan_request();
    }
  }

  for (auto it = persistent.rbegin(); it != persistent.rend(); ++it) memory.deallocate(it->p, it->n, al, it->tag);
  memory.release_cached();
  cli_checks::write_file("--trace", opt.trace_path, [&](std::ostream& os) { recorder.write_chrome_trace(os); });
  const mb::memory_stats s = memory.stats();
  std::printf("\nend: requested %s, reserved %s; the run's peak reserved was %s of a %s budget, %llu refusals\n",
              mb::format_bytes(s.requested).c_str(), mb::format_bytes(s.reserved).c_str(),
              mb::format_bytes(run_peak_reserved).c_str(), mb::format_bytes(memory.limit()).c_str(),
              static_cast<unsigned long long>(s.failed_allocations));
  std::printf("trace: %s (%zu events; open it in ui.perfetto.dev or chrome://tracing)\n",
              opt.trace_path.c_str(), recorder.size());
  return 0;
} catch (const mb::error& e) {
  std::fprintf(stderr, "error: %s\n", cli_checks::one_line(e.what()).c_str());
  return 1;
}
