// collective_watchdog's rules on a scripted device (no GPU): events whose state the test sets,
// an asynchronous error it can raise, and a count of aborts. The rules are nccl_communicator's
// timeout (dist/nccl_communicator.cuh), which needs two GPUs to see for real.
//   - collectives that finish hand their events back, in stream order, and nothing fails;
//   - before the deadline nothing fails; after it the oldest unfinished collective fails as
//     timed out at once, and the device is aborted only once that collective has reached the
//     device (its started event done), never while it is queued behind the caller's work;
//   - a failed event query or the library's asynchronous error aborts at once (not a timeout);
//   - the first failure is the one kept and abort() runs at most once;
//   - only the oldest collective decides (a later one cannot time out before it);
//   - with its thread, a collective past a 50 ms deadline fails and is aborted within seconds,
//     and stop() joins the thread and returns every event it still held.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "membound/dist/collective_watchdog.hpp"

namespace mb = membound;
using namespace std::chrono_literals;

namespace {

struct scripted_device {
  using event = int;
  std::map<int, mb::device_event_state> states;
  int async = 0;
  int aborts = 0;
  int thread_starts = 0;
  mb::device_event_state query(int e) { return states.at(e); }
  int async_error() { return async; }
  void abort() noexcept { ++aborts; }
  void on_thread_start() noexcept { ++thread_starts; }
};
static_assert(mb::watchdog_device<scripted_device>);

using watchdog = mb::collective_watchdog<scripted_device>;
using clock_type = watchdog::clock;

constexpr auto pending = mb::device_event_state::pending;
constexpr auto done = mb::device_event_state::done;
constexpr auto failed = mb::device_event_state::failed;

}  // namespace

TEST_CASE("collectives that finish give their events back and nothing fails") {
  scripted_device dev;
  watchdog dog(dev, 100ms, /*threaded=*/false);
  const auto t0 = clock_type::now();
  dev.states = {{1, done}, {2, done}, {3, done}, {4, pending}};
  dog.follow(1, 2, "first", t0);
  dog.follow(3, 4, "second", t0);
  dog.poll(t0 + 10ms);
  CHECK(dog.in_flight() == 1);  // the second is still running
  CHECK(dog.spare() == std::vector<int>{1, 2});
  dev.states[4] = done;
  dog.poll(t0 + 500ms);  // past the deadline, but done: no failure
  CHECK(dog.in_flight() == 0);
  CHECK(dog.spare() == std::vector<int>{1, 2, 3, 4});
  CHECK_FALSE(dog.failed());
  CHECK(dev.aborts == 0);
}

TEST_CASE("past its deadline a collective fails at once and is aborted once it reached the device") {
  scripted_device dev;
  watchdog dog(dev, 100ms, false);
  const auto t0 = clock_type::now();
  dev.states = {{1, pending}, {2, pending}};  // queued behind the caller's work
  dog.follow(1, 2, "all_gather", t0);
  dog.poll(t0 + 99ms);
  CHECK_FALSE(dog.failed());
  dog.poll(t0 + 100ms);
  REQUIRE(dog.failed());
  CHECK(std::string(dog.first_failure().call) == "all_gather");
  CHECK(dog.first_failure().timed_out);
  CHECK(dev.aborts == 0);  // not on the device yet: nothing to end, nothing freed under it
  CHECK_FALSE(dog.aborted());
  dog.poll(t0 + 300ms);
  CHECK(dev.aborts == 0);
  dev.states[1] = done;  // the device reached it; it waits for a rank that never joins
  dog.poll(t0 + 310ms);
  CHECK(dev.aborts == 1);
  CHECK(dog.aborted());
  dog.poll(t0 + 320ms);
  CHECK(dev.aborts == 1);  // at most once
  CHECK(dog.in_flight() == 1);  // its events stay until stop()
  const std::vector<int> left = dog.stop();
  CHECK(left.size() == 2);
}

TEST_CASE("a collective already on the device is aborted at its deadline") {
  scripted_device dev;
  watchdog dog(dev, 50ms, false);
  const auto t0 = clock_type::now();
  dev.states = {{1, done}, {2, pending}};
  dog.follow(1, 2, "reduce_scatter_sum", t0);
  dog.poll(t0 + 49ms);
  CHECK(dev.aborts == 0);
  dog.poll(t0 + 51ms);
  CHECK(dev.aborts == 1);
  CHECK(dog.first_failure().timed_out);
}

TEST_CASE("an asynchronous error or a failed event aborts at once, as an error") {
  SUBCASE("the library's asynchronous error") {
    scripted_device dev;
    watchdog dog(dev, 10s, false);
    const auto t0 = clock_type::now();
    dev.states = {{1, done}, {2, pending}};
    dog.follow(1, 2, "broadcast", t0);
    dev.async = 6;  // e.g. ncclRemoteError
    dog.poll(t0 + 1ms);
    REQUIRE(dog.failed());
    CHECK_FALSE(dog.first_failure().timed_out);
    CHECK(dog.first_failure().code == 6);
    CHECK(dev.aborts == 1);
  }
  SUBCASE("an event query that fails") {
    scripted_device dev;
    watchdog dog(dev, 10s, false);
    const auto t0 = clock_type::now();
    dev.states = {{1, done}, {2, failed}};
    dog.follow(1, 2, "all_gather", t0);
    dog.poll(t0 + 1ms);
    REQUIRE(dog.failed());
    CHECK(std::string(dog.first_failure().call) == "all_gather");
    CHECK_FALSE(dog.first_failure().timed_out);
    CHECK(dog.first_failure().code == -1);
    CHECK(dev.aborts == 1);
  }
}

TEST_CASE("the first failure is kept, and only the oldest collective decides") {
  scripted_device dev;
  watchdog dog(dev, 100ms, false);
  const auto t0 = clock_type::now();
  // The first enqueued late; the second enqueued early would be past its deadline, but it
  // cannot finish before the first (stream order), so only the first's deadline counts.
  dev.states = {{1, done}, {2, pending}, {3, pending}, {4, pending}};
  dog.follow(1, 2, "first", t0 + 50ms);
  dog.follow(3, 4, "second", t0);
  dog.poll(t0 + 120ms);
  CHECK_FALSE(dog.failed());
  dog.poll(t0 + 150ms);
  REQUIRE(dog.failed());
  CHECK(std::string(dog.first_failure().call) == "first");
  dog.mark({"later", false, 3});
  CHECK(std::string(dog.first_failure().call) == "first");
  dog.abort_device({"later still", false, 5});
  CHECK(std::string(dog.first_failure().call) == "first");
  CHECK(dev.aborts == 1);
}

TEST_CASE("with its thread: a late collective fails and is aborted; stop() joins and returns the events") {
  scripted_device dev;
  dev.states = {{1, done}, {2, pending}, {3, done}, {4, done}};
  watchdog dog(dev, 50ms, /*threaded=*/true, 1ms);
  {
    std::lock_guard<std::mutex> lock(dog.mutex());
    dog.follow(3, 4, "finished", clock_type::now());
    dog.follow(1, 2, "late", clock_type::now());
  }
  const auto deadline = clock_type::now() + 10s;
  bool seen = false;
  while (!seen && clock_type::now() < deadline) {
    std::this_thread::sleep_for(5ms);
    std::lock_guard<std::mutex> lock(dog.mutex());
    seen = dog.aborted();
  }
  CHECK(seen);
  std::vector<int> left = dog.stop();
  std::sort(left.begin(), left.end());
  CHECK(left == std::vector<int>{1, 2, 3, 4});
  CHECK(dev.thread_starts == 1);
  CHECK(dev.aborts == 1);
  CHECK(std::string(dog.first_failure().call) == "late");
}

TEST_CASE("without a timeout no thread runs") {
  scripted_device dev;
  watchdog dog(dev, 0ms);
  CHECK_FALSE(dog.enabled());
  std::this_thread::sleep_for(20ms);
  CHECK(dev.thread_starts == 0);
  CHECK(dog.stop().empty());
}
