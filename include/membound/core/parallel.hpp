// A small fixed-size thread pool for the CPU backend's kernels.
//
//   membound::thread_pool pool(4);                     // or thread_pool{} for every core
//   pool.parallel_for(n, [&](std::size_t task, std::size_t thread) { ... });
//
// `thread` is in [0, size()) and indexes per-thread scratch. Tasks are handed out dynamically,
// so kernels make each task's result depend only on the task (never on which thread ran it or
// in what order): results are then the same for every thread count. The calling thread works
// too; parallel_for is not reentrant (no nested calls from inside a task).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
#include <vector>

#include "membound/core/config.hpp"
#include "membound/core/error.hpp"

MEMBOUND_NAMESPACE_BEGIN

class thread_pool {
 public:
  // More threads than this only add contention (and per-thread scratch) on any host there is.
  static constexpr std::size_t max_threads = 1024;

  static std::size_t default_threads() noexcept {
    const unsigned n = std::thread::hardware_concurrency();
    if (n == 0) return 1;  // 0 means "unknown"
    return n < max_threads ? n : max_threads;
  }

  // Throws invalid_argument for 0 or more than max_threads threads, backend_error when the
  // system refuses a thread (the ones already started are stopped first).
  explicit thread_pool(std::size_t threads = default_threads()) {
    if (threads == 0 || threads > max_threads) {
      throw invalid_argument("threads",
                             "between 1 and " + std::to_string(max_threads) +
                                 " (thread_pool::max_threads)",
                             std::to_string(threads),
                             "Pass 1 to run every task on the calling thread, or "
                             "thread_pool::default_threads() for one per core");
    }
    workers_.reserve(threads - 1);
    try {
      for (std::size_t t = 1; t < threads; ++t) workers_.emplace_back([this, t] { work(t); });
    } catch (const std::system_error& e) {
      // Joinable threads must not outlive a constructor that throws (std::terminate otherwise).
      stop_all();
      throw backend_error("std::thread (worker " + std::to_string(workers_.size() + 1) + " of " +
                              std::to_string(threads) + ")",
                          e.code().value(), e.what(),
                          "The system refused another thread (ulimit -u, memory): pass fewer "
                          "threads");
    }
  }

  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;

  ~thread_pool() { stop_all(); }

  std::size_t size() const noexcept { return workers_.size() + 1; }

  // Runs f(task, thread) for every task in [0, n) and returns when all are done. The first
  // exception a task throws is rethrown here (tasks not yet started are skipped).
  template <typename F>
  void parallel_for(std::size_t n, F&& f) {
    if (n == 0) return;
    if (workers_.empty() || n == 1) {
      for (std::size_t i = 0; i < n; ++i) f(i, std::size_t{0});
      return;
    }
    using fn = std::remove_reference_t<F>;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      context_ = const_cast<void*>(static_cast<const void*>(std::addressof(f)));
      invoke_ = [](void* c, std::size_t i, std::size_t t) { (*static_cast<fn*>(c))(i, t); };
      tasks_ = n;
      next_.store(0);
      pending_ = workers_.size();
      error_ = nullptr;
      ++generation_;
    }
    wake_.notify_all();
    run_tasks(0);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return pending_ == 0; });
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void stop_all() noexcept {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread& w : workers_) w.join();
  }

  void run_tasks(std::size_t thread) {
    for (;;) {
      const std::size_t i = next_.fetch_add(1);
      if (i >= tasks_) return;
      try {
        invoke_(context_, i, thread);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
        next_.store(tasks_);
      }
    }
  }

  void work(std::size_t thread) {
    std::size_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      run_tasks(thread);
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  bool stop_ = false;
  std::size_t generation_ = 0;
  std::size_t pending_ = 0;
  std::size_t tasks_ = 0;
  std::atomic<std::size_t> next_{0};
  void* context_ = nullptr;
  void (*invoke_)(void*, std::size_t, std::size_t) = nullptr;
  std::exception_ptr error_;
};

// How many per-thread scratch slices a layer's workspace holds for this executor: the pool's
// threads. Every size function takes it; a device executor has its own overload (1: the device's
// workspaces do not grow with it).
inline std::size_t workspace_threads(const thread_pool& pool) noexcept { return pool.size(); }

MEMBOUND_NAMESPACE_END
