// Sizes that come from a caller or from a file are checked before anything is sized from them:
// too large is a typed error naming the argument and the largest accepted value, and memory the
// host cannot give is out_of_memory, never std::length_error or std::bad_alloc. A checkpoint whose
// header claims more than the file holds is corrupt_checkpoint.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <typeinfo>
#include <vector>

#include "membound/core/parallel.hpp"
#include "membound/memory/trace.hpp"
#include "membound/train/checkpoint_file.hpp"

namespace mb = membound;
namespace fs = std::filesystem;

#if defined(__SANITIZE_ADDRESS__)
#define MB_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MB_TEST_ASAN 1
#endif
#endif
#ifndef MB_TEST_ASAN
#define MB_TEST_ASAN 0
#endif

namespace {

constexpr std::size_t size_max = std::numeric_limits<std::size_t>::max();

// f must throw invalid_argument naming `argument`, with the largest accepted value in the message.
template <typename F>
void refused(F&& f, const std::string& argument, const std::string& largest) {
  try {
    f();
    FAIL_CHECK("accepted");
  } catch (const mb::invalid_argument& e) {
    CHECK(e.argument() == argument);
    CHECK(std::string(e.what()).find(largest) != std::string::npos);
    CHECK_FALSE(e.what_to_do().empty());
  } catch (const std::exception& e) {
    FAIL_CHECK("escaped " << typeid(e).name() << ": " << e.what());
  }
}

// Whether an allocation far beyond the machine fails at once here (no overcommit of everything,
// no sanitizer that aborts on it) rather than succeeding and being touched.
bool huge_allocations_fail() {
  if (MB_TEST_ASAN) return false;
  std::ifstream in("/proc/sys/vm/overcommit_memory");
  int mode = -1;
  in >> mode;
  return mode == 0 || mode == 2;
}

}  // namespace

TEST_CASE("sizes: trace_recorder's capacity is checked against max_capacity") {
  const std::string largest = std::to_string(mb::trace_recorder::max_capacity);
  for (std::size_t capacity : {std::size_t{0}, mb::trace_recorder::max_capacity + 1,
                               std::size_t{1} << 40, size_max / sizeof(mb::trace_event) + 1,
                               size_max / 2, size_max - 1, size_max}) {
    CAPTURE(capacity);
    refused([&] { mb::trace_recorder r(capacity); }, "capacity", largest);
  }
  // The sizes people use are well inside.
  CHECK(mb::trace_recorder::max_capacity >= (std::size_t{1} << 20));
  mb::trace_recorder r(1 << 16);
  CHECK(r.capacity() == (1u << 16));
}

TEST_CASE("sizes: thread_pool's thread count is checked against max_threads") {
  const std::string largest = std::to_string(mb::thread_pool::max_threads);
  for (std::size_t threads : {std::size_t{0}, mb::thread_pool::max_threads + 1,
                              std::size_t{1} << 20, size_max / 2, size_max}) {
    CAPTURE(threads);
    refused([&] { mb::thread_pool p(threads); }, "threads", largest);
  }
  CHECK(mb::thread_pool::default_threads() >= 1);
  CHECK(mb::thread_pool::default_threads() <= mb::thread_pool::max_threads);
}

TEST_CASE("sizes: checkpoint_writer::add refuses impossible sections and stays unchanged") {
  const auto dir = fs::temp_directory_path() / ("mb_sizes_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string path = (dir / "w.ckpt").string();

  mb::checkpoint_writer w;
  w.add_value<std::uint64_t>("step", 3);
  const unsigned char byte = 7;
  const std::string largest = mb::format_bytes(mb::checkpoint_writer::max_bytes);
  for (std::size_t bytes : {mb::checkpoint_writer::max_bytes, mb::checkpoint_writer::max_bytes + 1,
                            size_max / 2, size_max - 15, size_max - 8, size_max}) {
    CAPTURE(bytes);
    refused([&] { w.add("huge", &byte, bytes); }, "bytes", largest);
  }
  refused([&] { w.add("null", nullptr, 8); }, "data", "nullptr");
  if (huge_allocations_fail()) {
    // Accepted by the check (below max_bytes) but beyond any host's address space.
    try {
      w.add("too much", &byte, std::size_t{200} << 40);
      FAIL_CHECK("a 200 TiB section was accepted");
    } catch (const mb::out_of_memory& e) {
      CHECK(e.report().requested > (std::size_t{200} << 40));
      CHECK(e.report().source == "checkpoint_writer::add");
    } catch (const std::exception& e) {
      FAIL_CHECK("escaped " << typeid(e).name() << ": " << e.what());
    }
  } else {
    MESSAGE("huge allocations may succeed here (overcommit or a sanitizer): that case is skipped");
  }
  // Nothing of the refused sections was kept: the file holds exactly the good one.
  w.add_value<std::uint64_t>("after", 4);
  w.commit(path);
  const mb::checkpoint_reader r(path);
  CHECK(r.value<std::uint64_t>("step") == 3);
  CHECK(r.value<std::uint64_t>("after") == 4);
  CHECK_FALSE(r.has("huge"));
  CHECK_FALSE(r.has("null"));
  CHECK_FALSE(r.has("too much"));
  fs::remove_all(dir);
}

namespace {
void put_u64(std::vector<unsigned char>& b, std::size_t at, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) b[at + static_cast<std::size_t>(i)] = static_cast<unsigned char>(v >> (8 * i));
}
// Rewrites the trailing CRC, so that only the field changed is wrong.
void reseal(std::vector<unsigned char>& b) {
  const std::size_t body = b.size() - 4;
  const std::uint32_t crc = mb::detail::crc32(b.data(), body);
  for (int i = 0; i < 4; ++i) b[body + static_cast<std::size_t>(i)] = static_cast<unsigned char>(crc >> (8 * i));
}
}  // namespace

TEST_CASE("sizes: a checkpoint header that claims more than the file holds is corrupt_checkpoint") {
  const auto dir = fs::temp_directory_path() / ("mb_sizes_hdr_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string good = (dir / "good.ckpt").string(), bad = (dir / "bad.ckpt").string();
  mb::checkpoint_writer w;
  const std::vector<float> x(64, 1.0f);
  w.add("weights", x.data(), x.size() * sizeof(float));
  w.add_value<std::uint64_t>("step", 9);
  w.add("empty", nullptr, 0);
  w.commit(good);
  std::vector<unsigned char> bytes;
  {
    std::ifstream in(good, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

  // Offsets of every size field: the section count, then each section's name and byte lengths.
  std::vector<std::size_t> fields{8};
  for (std::size_t at = 16, s = 0; s < 3; ++s) {
    fields.push_back(at);
    const std::size_t name = mb::detail::get_u64(bytes.data() + at);
    at += 8 + name;
    fields.push_back(at);
    at += 8 + mb::detail::get_u64(bytes.data() + at);
  }
  int tried = 0, refused_ok = 0;
  for (std::size_t at : fields) {
    for (std::uint64_t v : {~std::uint64_t{0}, std::uint64_t{1} << 63, (std::uint64_t{1} << 63) + 5,
                            std::uint64_t{1} << 40, std::uint64_t{1} << 32,
                            static_cast<std::uint64_t>(bytes.size()),
                            mb::detail::get_u64(bytes.data() + at) + 1}) {
      CAPTURE(at);
      CAPTURE(v);
      std::vector<unsigned char> b = bytes;
      put_u64(b, at, v);
      reseal(b);
      std::ofstream(bad, std::ios::binary).write(reinterpret_cast<const char*>(b.data()),
                                                 static_cast<std::streamsize>(b.size()));
      ++tried;
      try {
        mb::checkpoint_reader r(bad);
        FAIL_CHECK("accepted");
      } catch (const mb::corrupt_checkpoint& e) {
        ++refused_ok;
        CHECK(e.path() == bad);
      } catch (const std::exception& e) {
        FAIL_CHECK("escaped " << typeid(e).name() << ": " << e.what());
      }
    }
  }
  CHECK(tried == 49);
  CHECK(refused_ok == tried);

  // A file larger than host memory (sparse, so it costs no disk) is out_of_memory, not bad_alloc.
  const std::string sparse = (dir / "sparse.ckpt").string();
  const int fd = ::open(sparse.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  REQUIRE(fd >= 0);
  const bool made = ::ftruncate(fd, static_cast<off_t>(std::uint64_t{8} << 40)) == 0;  // 8 TiB
  ::close(fd);
  if (made && huge_allocations_fail()) {
    try {
      mb::checkpoint_reader r(sparse);
      FAIL_CHECK("an 8 TiB checkpoint was read");
    } catch (const mb::out_of_memory& e) {
      CHECK(e.report().requested == (std::size_t{8} << 40));
      CHECK(std::string(e.what()).find(sparse) != std::string::npos);
    } catch (const std::exception& e) {
      FAIL_CHECK("escaped " << typeid(e).name() << ": " << e.what());
    }
  } else {
    MESSAGE("no 8 TiB sparse file or huge allocations may succeed here: that case is skipped");
  }
  fs::remove_all(dir);
}
