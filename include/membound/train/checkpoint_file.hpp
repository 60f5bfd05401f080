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
// atomic within a folder, and the folder's fsync makes the rename itself durable. Every byte is
// covered by a CRC-32, so truncation and bit flips are refused with a message naming the file.
//
// Layout (little-endian): "MBCKPT\0\1", u64 section count, per section {u64 name length, name,
// u64 byte length, bytes}, then u32 CRC-32 of everything before it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include "membound/core/config.hpp"
#include "membound/core/error.hpp"

MEMBOUND_NAMESPACE_BEGIN

// A checkpoint file that cannot be used: missing, truncated, corrupted, or without a section.
class corrupt_checkpoint : public error {
 public:
  corrupt_checkpoint(const std::string& path, const std::string& why)
      : error("membound: checkpoint '" + path + "' cannot be used: " + why +
              ". Resume from an earlier checkpoint or start without --resume"),
        path_(path) {}
  const std::string& path() const noexcept { return path_; }

 private:
  std::string path_;
};

namespace detail {

// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320), table built once.
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

inline void put_u64(std::vector<unsigned char>& out, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<unsigned char>(v >> (8 * i)));
}
inline std::uint64_t get_u64(const unsigned char* p) noexcept {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(p[i]) << (8 * i);
  return v;
}

inline std::string parent_dir(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace detail

class checkpoint_writer {
 public:
  void add(const std::string& name, const void* data, std::size_t bytes) {
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

  // Writes the file atomically. Throws membound::error naming the path and the failing call;
  // the previous file at `path` is then untouched.
  void commit(const std::string& path) const {
    std::vector<unsigned char> out(detail::checkpoint_magic, detail::checkpoint_magic + 8);
    detail::put_u64(out, sections_);
    out.insert(out.end(), buf_.begin(), buf_.end());
    const std::uint32_t crc = detail::crc32(out.data(), out.size());
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<unsigned char>(crc >> (8 * i)));

    const std::string tmp = path + ".tmp." + std::to_string(::getpid());
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) fail(path, "cannot create the temporary file '" + tmp + "'");
    std::size_t done = 0;
    while (done < out.size()) {
      const ssize_t w = ::write(fd, out.data() + done, out.size() - done);
      if (w <= 0) {
        ::close(fd);
        ::unlink(tmp.c_str());
        fail(path, "write to '" + tmp + "' failed (disk full?)");
      }
      done += static_cast<std::size_t>(w);
    }
    if (::fsync(fd) != 0) {
      ::close(fd);
      ::unlink(tmp.c_str());
      fail(path, "fsync of '" + tmp + "' failed");
    }
    ::close(fd);
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      ::unlink(tmp.c_str());
      fail(path, "rename of '" + tmp + "' over it failed");
    }
    const int dfd = ::open(detail::parent_dir(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {  // the rename is durable once the folder is synced
      ::fsync(dfd);
      ::close(dfd);
    }
  }

 private:
  [[noreturn]] static void fail(const std::string& path, const std::string& why) {
    throw error("membound: cannot write checkpoint '" + path + "': " + why +
                "; the previous checkpoint is untouched");
  }
  std::vector<unsigned char> buf_;
  std::uint64_t sections_ = 0;
};

class checkpoint_reader {
 public:
  explicit checkpoint_reader(const std::string& path) : path_(path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw corrupt_checkpoint(path, "the file does not exist or cannot be read");
    data_.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
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
