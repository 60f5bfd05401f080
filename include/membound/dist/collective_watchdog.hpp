// A watchdog for collectives that run on a device: what nccl_communicator's timeout is, written
// against a small device interface so that its rules run (and are tested) on the host.
//
// The communicator, holding mutex(), hands over each collective as it enqueues it: an event
// recorded when the device reaches it (its stream has passed the caller's earlier work), an
// event recorded after it, its name and when it was enqueued. A thread (or a test calling poll())
// looks, every period, at the oldest collective not yet done (stream order: it holds the rest):
//   - done: its events are free for reuse (spare());
//   - the device library reports an asynchronous error, or an event query fails: failed, and the
//     device's work aborted (Device::abort(): NCCL's ncclCommAbort);
//   - not done `timeout` after its enqueue: failed (timed out) at once, so the caller's next call
//     throws; aborted only once the device has reached it, so an abort never frees the library's
//     resources under a kernel still queued behind the caller's own work.
// The deadline runs from the enqueue, as PyTorch's NCCL watchdog's does. The first failure is the
// one kept; abort() is called at most once.
//
//   struct my_device {
//     using event = cudaEvent_t;
//     device_event_state query(event e);   // done, pending or failed (cudaEventQuery)
//     int async_error();                    // 0: none (ncclCommGetAsyncError)
//     void abort() noexcept;                // end the device work (ncclCommAbort)
//     void on_thread_start() noexcept;      // the watchdog thread's setup (cudaSetDevice)
//   };
#pragma once

#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "membound/core/config.hpp"

MEMBOUND_NAMESPACE_BEGIN

enum class device_event_state { done, pending, failed };

template <typename D>
concept watchdog_device = requires(D& d, typename D::event e) {
  { d.query(e) } -> std::same_as<device_event_state>;
  { d.async_error() } -> std::convertible_to<int>;
  { d.abort() } noexcept;
  { d.on_thread_start() } noexcept;
};

template <watchdog_device Device>
class collective_watchdog {
 public:
  using clock = std::chrono::steady_clock;
  using event = typename Device::event;
  // How the first failure happened: the collective's name (a string literal), whether it timed
  // out (else an error with `code`: the library's, -1 for a failed event query, -2 when the
  // watchdog itself could not go on).
  struct failure {
    const char* call = nullptr;
    bool timed_out = false;
    int code = 0;
  };

  // timeout 0: nothing is followed and no thread runs (the mutex still serves the caller).
  // threaded false: no thread either; the caller drives poll() (tests).
  collective_watchdog(Device& device, std::chrono::milliseconds timeout, bool threaded = true,
                      std::chrono::milliseconds period = std::chrono::milliseconds(5))
      : device_(device), timeout_(timeout), period_(period) {
    if (threaded && timeout.count() > 0) thread_ = std::thread([this] { run(); });
  }
  collective_watchdog(const collective_watchdog&) = delete;
  collective_watchdog& operator=(const collective_watchdog&) = delete;
  // The owner calls stop() first and destroys the events it returns; this only joins the thread.
  ~collective_watchdog() {
    try {
      (void)stop();
    } catch (...) {  // the list of events could not be made: the thread is joined all the same
    }
  }

  std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  bool enabled() const noexcept { return timeout_.count() > 0; }
  // The caller holds it while it calls the device library and while it reads the state below.
  std::mutex& mutex() const noexcept { return m_; }

  // ---- Under mutex() -----------------------------------------------------------------------------
  // Follow one collective; its events are the watchdog's until spare() hands them back.
  void follow(event started, event done, const char* call, clock::time_point enqueued) {
    flights_.push_back(flight{started, done, enqueued, call});
    wake_.notify_one();
  }
  // One look at the oldest collectives at time `now` (the thread's body).
  void poll(clock::time_point now) {
    if (aborted_) return;
    if (const int e = device_.async_error(); e != 0) {
      abort_device({"an asynchronous error of the device library", false, e});
      return;
    }
    while (!flights_.empty()) {
      const flight f = flights_.front();
      const device_event_state s = device_.query(f.done);
      if (s == device_event_state::done) {
        spare_.push_back(f.started);
        spare_.push_back(f.done);
        flights_.pop_front();
        continue;
      }
      if (s == device_event_state::failed) {
        abort_device({f.call, false, -1});
      } else if (now - f.enqueued >= timeout_) {
        mark({f.call, true, 0});  // callers learn it now
        const device_event_state reached = device_.query(f.started);
        if (reached != device_event_state::pending) abort_device({f.call, true, 0});
      }
      return;
    }
  }
  // A failure the caller saw itself (a call past its deadline, an error returned): kept if first.
  void mark(failure f) noexcept {
    if (failure_.call == nullptr) failure_ = f;
  }
  // mark(f), then the device's work ended (once).
  void abort_device(failure f) noexcept {
    mark(f);
    if (aborted_) return;
    aborted_ = true;
    device_.abort();
  }
  bool failed() const noexcept { return failure_.call != nullptr; }
  const failure& first_failure() const noexcept { return failure_; }
  bool aborted() const noexcept { return aborted_; }
  std::size_t in_flight() const noexcept { return flights_.size(); }
  // Events of finished collectives, for reuse (the caller takes them).
  std::vector<event>& spare() noexcept { return spare_; }
  // ---- End of "under mutex()" --------------------------------------------------------------------

  // Joins the thread (not under mutex()); then every event still held, for the caller to destroy.
  std::vector<event> stop() {
    if (thread_.joinable()) {
      {
        std::lock_guard<std::mutex> lock(m_);
        stop_ = true;
      }
      wake_.notify_one();
      thread_.join();
    }
    std::lock_guard<std::mutex> lock(m_);
    std::vector<event> all = std::move(spare_);
    spare_.clear();
    for (const flight& f : flights_) {
      all.push_back(f.started);
      all.push_back(f.done);
    }
    flights_.clear();
    return all;
  }

 private:
  struct flight {
    event started;
    event done;
    clock::time_point enqueued;
    const char* call;
  };

  void run() noexcept {
    device_.on_thread_start();
    std::unique_lock<std::mutex> lock(m_);
    while (!stop_) {
      wake_.wait_for(lock, period_);
      if (stop_) break;
      try {
        poll(clock::now());
      } catch (...) {  // spare_'s growth, or the device's calls: give up on the device, not the process
        abort_device({"the collective watchdog", false, -2});
      }
    }
  }

  Device& device_;
  std::chrono::milliseconds timeout_;
  std::chrono::milliseconds period_;
  mutable std::mutex m_;
  std::condition_variable wake_;
  std::thread thread_;
  bool stop_ = false;
  bool aborted_ = false;
  failure failure_{};
  std::deque<flight> flights_;
  std::vector<event> spare_;
};

MEMBOUND_NAMESPACE_END
