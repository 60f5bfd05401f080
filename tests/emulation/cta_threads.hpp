// The host threads that play a CTA's threads in the kernel emulations (*_cuda_emulate.cpp), kept
// from one CTA to the next. Starting a CTA's 64 to 128 threads and joining them again was most of
// an emulation's time under ThreadSanitizer, for which starting a thread is the costliest event;
// a kept team costs two barrier phases per CTA.
//
// What TSan can see is unchanged: run() orders everything before it before every thread's body
// and every body before its return (a barrier both ways, as the start and the join did), so
// the only unordered accesses left are those between one CTA's threads, a missing __syncthreads.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace emu_support {

// __syncthreads (and a warp's rendezvous): n threads wait until all n have arrived; reusable.
// A mutex and a condition variable rather than std::barrier: libstdc++'s barrier waits by
// spinning on atomic loads with sched_yield, and under ThreadSanitizer every one of those loads
// merges a vector clock, which made the barriers most of an emulation's time. Here a waiting
// thread sleeps, and the mutex orders every write before the barrier before every read after it.
class barrier {
 public:
  explicit barrier(std::ptrdiff_t n) : n_(n) {}
  barrier(const barrier&) = delete;
  barrier& operator=(const barrier&) = delete;

  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(m_);
    const std::size_t phase = phase_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++phase_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return phase_ != phase; });
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  std::ptrdiff_t n_, arrived_ = 0;
  std::size_t phase_ = 0;
};

class cta_threads {
 public:
  explicit cta_threads(unsigned n) : start_(n + 1), done_(n + 1) {
    threads_.reserve(n);
    for (unsigned t = 0; t < n; ++t) threads_.emplace_back([this, t] { work(t); });
  }
  cta_threads(const cta_threads&) = delete;
  cta_threads& operator=(const cta_threads&) = delete;
  ~cta_threads() {
    stop_ = true;  // read after the start barrier: ordered by it
    start_.arrive_and_wait();
    for (auto& th : threads_) th.join();
  }

  unsigned size() const noexcept { return static_cast<unsigned>(threads_.size()); }

  // body(t) on the team's thread t for every t < size(); returns when every body has returned.
  void run(const std::function<void(unsigned)>& body) {
    body_ = &body;
    start_.arrive_and_wait();
    done_.arrive_and_wait();
  }

 private:
  void work(unsigned t) {
    for (;;) {
      start_.arrive_and_wait();
      if (stop_) return;
      (*body_)(t);
      done_.arrive_and_wait();
    }
  }

  barrier start_, done_;
  const std::function<void(unsigned)>* body_ = nullptr;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

// The team of n threads, started on first use and kept until the program exits.
inline cta_threads& cta_team(unsigned n) {
  static std::map<unsigned, std::unique_ptr<cta_threads>> teams;
  auto& team = teams[n];
  if (!team) team = std::make_unique<cta_threads>(n);
  return *team;
}

}  // namespace emu_support
