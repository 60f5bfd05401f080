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
#include <thread>
#include <type_traits>
#include <vector>

#include "membound/core/config.hpp"
#include "membound/core/error.hpp"

MEMBOUND_NAMESPACE_BEGIN

class thread_pool {
 public:
  static std::size_t default_threads() noexcept {
    const unsigned n = std::thread::hardware_concurrency();
    return n == 0 ? 1 : n;  // 0 means "unknown"
  }

  explicit thread_pool(std::size_t threads = default_threads()) {
    if (threads == 0) {
      throw invalid_argument("threads", "at least 1", "0",
                             "Pass 1 to run every task on the calling thread");
    }
    workers_.reserve(threads - 1);
    for (std::size_t t = 1; t < threads; ++t) workers_.emplace_back([this, t] { work(t); });
  }

  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;

  ~thread_pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread& w : workers_) w.join();
  }

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

MEMBOUND_NAMESPACE_END
