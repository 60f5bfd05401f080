// Training checkpoints: named binary sections in one file, written atomically and verified on
// load.
//
//   checkpoint_writer w;
//   w.add("weights", w_ptr, bytes);
//   w.add_value("step", step);
//   w.commit("run/ckpt.bin");          // temp file in the same folder, fsync, rename, fsync folder
//   checkpoint_reader r("run/ckpt.bin");  // throws corrupt_checkpoint on a bad file
//   r.copy("weights", w_ptr, bytes);      // exact size or a typed error
//
// A crash at any point leaves either the previous file or the new one, never a mix: rename is
// atomic within a folder, and the folder's fsync makes the rename itself durable. The temporary a
// killed writer leaves (`ckpt.bin.tmp.<pid>.<n>`) is removed by the next commit or read of the same
// path (core/file_io.hpp says when it is safe). Every byte is covered by a CRC-32, so truncation
// and bit flips are refused with a message naming the file.
//
// Layout (little-endian): "MBCKPT\0\1", u64 section count, per section {u64 name length, name,
// u64 byte length, bytes}, then u32 CRC-32 of everything before it.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/core/file_io.hpp"
#include "membound/core/format.hpp"

MEMBOUND_NAMESPACE_BEGIN

// A checkpoint file that cannot be used: missing, not a regular file, unreadable, truncated,
// corrupted, or without a section. A file_error, so one catch covers every file problem.
class corrupt_checkpoint : public file_error {
 public:
  static constexpr const char* default_what_to_do =
      "Resume from an earlier checkpoint or start without --resume";

  corrupt_checkpoint(const std::string& path, const std::string& why,
                     const std::string& what_to_do = default_what_to_do, int error_number = 0)
      : file_error(own_message{},
                   "membound: checkpoint '" + path + "' cannot be used: " + why + ". " + what_to_do,
                   "path", path, "a readable membound checkpoint", why, what_to_do,
                   error_number) {}

  // A problem with the file itself, found before its contents were read (missing, a folder, a
  // FIFO, no permission): its fields as they are, in a checkpoint's message.
  explicit corrupt_checkpoint(const file_error& e)
      : file_error(own_message{},
                   "membound: checkpoint '" + e.path() + "' cannot be used: expected " +
                       e.expected() + ", got " + e.actual() + ". " + e.what_to_do(),
                   "path", e.path(), e.expected(), e.actual(), e.what_to_do(), e.error_number()) {}
};

namespace detail {

// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320), table built once. Chains: crc32(b, m,
// crc32(a, n)) is the CRC of a followed by b.
inline std::uint32_t crc32(const unsigned char* p, std::size_t n, std::uint32_t crc = 0) noexcept {
  static const std::array<std::uint32_t, 256> table = [] {
    std::array<std::uint32_t, 256> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  crc = ~crc;
  for (std::size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

inline constexpr char checkpoint_magic[8] = {'M', 'B', 'C', 'K', 'P', 'T', '\0', '\1'};

inline void put_u64(unsigned char* out, std::uint64_t v) noexcept {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<unsigned char>(v >> (8 * i));
}
inline void put_u64(std::vector<unsigned char>& out, std::uint64_t v) {
  unsigned char b[8];
  put_u64(b, v);
  out.insert(out.end(), b, b + 8);
}
inline std::uint64_t get_u64(const unsigned char* p) noexcept {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(p[i]) << (8 * i);
  return v;
}

}  // namespace detail

class checkpoint_writer {
 public:
  // The most bytes all sections together (names and sizes included) may hold.
  static constexpr std::size_t max_bytes = std::size_t{1} << 48;  // 256 TiB

  // Appends a section. On a throw nothing was added: invalid_argument for a null `data` with
  // bytes, or a size beyond max_bytes; out_of_memory when host memory cannot hold the copy.
  void add(const std::string& name, const void* data, std::size_t bytes) {
    if (data == nullptr && bytes != 0) {
      throw invalid_argument("data", "a pointer to the section's " + std::to_string(bytes) + " bytes",
                             "nullptr", "Pass the section's buffer, or 0 bytes for an empty section");
    }
    const std::size_t room = max_bytes - buf_.size();  // buf_ never exceeds max_bytes
    if (name.size() > room || 16 > room - name.size() || bytes > room - name.size() - 16) {
      throw invalid_argument(
          "bytes", "at most " + format_bytes(room > 16 + name.size() ? room - 16 - name.size() : 0) +
                       " for section '" + name + "' (a checkpoint holds at most " +
                       format_bytes(max_bytes) + ")",
          format_bytes(bytes),
          "Check the size computation (a negative value converted to std::size_t?)");
    }
    const std::size_t need = buf_.size() + 16 + name.size() + bytes;
    try {
      // Geometric growth, so many small sections copy the buffer O(log n) times.
      if (need > buf_.capacity()) buf_.reserve(std::max(need, std::min(max_bytes, 2 * buf_.capacity())));
    } catch (const std::bad_alloc&) {
      detail::throw_host_out_of_memory(
          "checkpoint_writer::add", need,
          "the checkpoint is built in host memory before it is written: free host memory");
    }
    // Within the reserved capacity from here on: nothing below can throw.
    detail::put_u64(buf_, name.size());
    buf_.insert(buf_.end(), name.begin(), name.end());
    detail::put_u64(buf_, bytes);
    const auto* p = static_cast<const unsigned char*>(data);
    buf_.insert(buf_.end(), p, p + bytes);
    ++sections_;
  }
  template <typename T>
  void add_value(const std::string& name, const T& v) {
    static_assert(std::is_trivially_copyable_v<T>, "membound: add_value stores trivially copyable values; use add() for buffers.");
    add(name, &v, sizeof(T));
  }

  // Writes the file atomically and removes temporaries killed writers left for this path. Throws
  // file_error naming the path, what it expected and the failing call (a folder, a missing
  // folder, no permission, a full disk); the previous file at `path` is then untouched.
  void commit(const std::string& path) const {
    unsigned char head[16];
    std::memcpy(head, detail::checkpoint_magic, 8);
    detail::put_u64(head + 8, sections_);
    const std::uint32_t crc = detail::crc32(buf_.data(), buf_.size(), detail::crc32(head, 16));
    unsigned char tail[4];
    for (int i = 0; i < 4; ++i) tail[i] = static_cast<unsigned char>(crc >> (8 * i));
    // Written in three parts: the sections are not copied once more.
    const detail::byte_range parts[] = {{head, 16}, {buf_.data(), buf_.size()}, {tail, 4}};
    detail::write_file_atomically(path, "path", "checkpoint", parts);
  }

 private:
  std::vector<unsigned char> buf_;
  std::uint64_t sections_ = 0;
};

class checkpoint_reader {
 public:
  // Reads and checks the whole file; a file that is missing, not a regular file (a folder, a
  // FIFO, a device), unreadable, empty, truncated or corrupted throws corrupt_checkpoint naming
  // it. Also removes the temporaries killed writers left for this path.
  explicit checkpoint_reader(const std::string& path) : path_(path) {
    detail::remove_stale_temporaries(path);
    try {
      data_ = detail::read_regular_file(path, "path", "checkpoint");
    } catch (const file_error& e) {
      throw corrupt_checkpoint(e);
    }
    if (data_.empty()) throw corrupt_checkpoint(path, "it is empty (0 bytes)");
    if (data_.size() < 8 + 8 + 4 || std::memcmp(data_.data(), detail::checkpoint_magic, 8) != 0) {
      throw corrupt_checkpoint(path, data_.size() < 20 ? "it is truncated (" + std::to_string(data_.size()) + " bytes)"
                                                       : "it is not a membound checkpoint (bad magic)");
    }
    const std::size_t body = data_.size() - 4;
    std::uint32_t stored = 0;
    for (int i = 0; i < 4; ++i) stored |= static_cast<std::uint32_t>(data_[body + static_cast<std::size_t>(i)]) << (8 * i);
    if (detail::crc32(data_.data(), body) != stored) {
      throw corrupt_checkpoint(path, "its checksum does not match (truncated or corrupted)");
    }
    const std::uint64_t n = detail::get_u64(data_.data() + 8);
    std::size_t at = 16;
    for (std::uint64_t s = 0; s < n; ++s) {
      if (at + 8 > body) throw corrupt_checkpoint(path, "section table runs past the end");
      const std::uint64_t len = detail::get_u64(data_.data() + at);
      at += 8;
      if (len > body - at) throw corrupt_checkpoint(path, "section name runs past the end");
      std::string name(reinterpret_cast<const char*>(data_.data() + at), len);
      at += len;
      if (at + 8 > body) throw corrupt_checkpoint(path, "section size runs past the end");
      const std::uint64_t bytes = detail::get_u64(data_.data() + at);
      at += 8;
      if (bytes > body - at) throw corrupt_checkpoint(path, "section '" + name + "' runs past the end");
      sections_.push_back({std::move(name), at, bytes});
      at += bytes;
    }
    if (at != body) throw corrupt_checkpoint(path, "trailing bytes after the last section");
  }

  bool has(const std::string& name) const noexcept { return find(name) != nullptr; }
  std::size_t size(const std::string& name) const { return need(name).bytes; }

  // Copies section `name`, which must hold exactly `bytes`.
  void copy(const std::string& name, void* dst, std::size_t bytes) const {
    const section& s = need(name);
    if (s.bytes != bytes) {
      throw corrupt_checkpoint(path_, "section '" + name + "' holds " + std::to_string(s.bytes) +
                                          " bytes where this run expects " + std::to_string(bytes) +
                                          " (a different model or precision?)");
    }
    std::memcpy(dst, data_.data() + s.offset, bytes);
  }
  // Section `name` as it is in the file (valid while the reader lives).
  std::span<const std::byte> view(const std::string& name) const {
    const section& s = need(name);
    return {reinterpret_cast<const std::byte*>(data_.data() + s.offset), s.bytes};
  }
  template <typename T>
  T value(const std::string& name) const {
    static_assert(std::is_trivially_copyable_v<T>);
    T v{};
    copy(name, &v, sizeof(T));
    return v;
  }

 private:
  struct section {
    std::string name;
    std::size_t offset = 0, bytes = 0;
  };
  const section* find(const std::string& name) const noexcept {
    for (const section& s : sections_)
      if (s.name == name) return &s;
    return nullptr;
  }
  const section& need(const std::string& name) const {
    const section* s = find(name);
    if (s == nullptr) throw corrupt_checkpoint(path_, "it has no section '" + name + "'");
    return *s;
  }
  std::string path_;
  std::vector<unsigned char> data_;
  std::vector<section> sections_;
};

MEMBOUND_NAMESPACE_END
