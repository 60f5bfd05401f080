// Files the library reads and writes itself (checkpoints, traces). Every failure is one
// file_error naming the path, what was expected and what to do: nothing from <fstream> or
// <filesystem> escapes, and nothing but a regular file is ever opened (reading a FIFO blocks
// until a writer comes; opening a device can have side effects).
//
//   std::vector<unsigned char> b = detail::read_regular_file(path, "path", "checkpoint");
//   const detail::byte_range parts[] = {{header, 16}, {body, n}};
//   detail::write_file_atomically(path, "path", "checkpoint", parts);
//
// An atomic write goes to `<path>.tmp.<pid>.<n>` in the same folder, under an exclusive flock held
// until it has been renamed over `path`, so a crash leaves the old file and at worst that
// temporary. The next write or read of the same path removes such leftovers:
// remove_stale_temporaries() takes only those whose writer is gone (see there).
// POSIX only, as the rest of the host side.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/core/format.hpp"

MEMBOUND_NAMESPACE_BEGIN

namespace detail {

struct byte_range {
  const void* data = nullptr;
  std::size_t size = 0;
};

inline std::string parent_dir(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}
inline std::string base_name(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

inline std::string errno_text(int e) {
  return std::string(std::strerror(e)) + " (errno " + std::to_string(e) + ")";
}

inline const char* file_kind(mode_t m) noexcept {
  if (S_ISREG(m)) return "a regular file";
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO (named pipe)";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "a special file";
}

// What a failed open, stat, write or rename means for the person who chose the path.
inline std::string advice_for(int e, bool writing) {
  switch (e) {
    case ENOENT:
      return writing ? "Create the folder first (mkdir -p) or choose another path"
                     : "Check the path (a relative path starts at the working directory)";
    case EACCES:
    case EPERM:
      return writing ? "Choose a folder this user may write to, or fix its permissions (chmod u+w)"
                     : "Make the file and its folders readable by this user (chmod u+r), or run "
                       "as its owner";
    case EROFS: return "Choose a path on a writable file system";
    case ENOTDIR: return "Fix the path: one of its folders is a file";
    case EISDIR: return "Pass a file path, not a folder";
    case ENAMETOOLONG: return "Use a shorter path";
    case ELOOP: return "Fix the symbolic links in the path (there is a loop)";
    case ENOSPC:
    case EDQUOT: return "Free disk space (or quota) or choose another file system";
    case EIO: return "The device reported an I/O error: check it (dmesg) and try again";
    case EFBIG:
      return "The file would exceed the largest file this process may write (ulimit -f) or the "
             "file system allows: raise the limit or choose another file system";
    default: return "Check the path and the file system";
  }
}

// An open descriptor, closed on every path.
class file_descriptor {
 public:
  explicit file_descriptor(int fd = -1) noexcept : fd_(fd) {}
  file_descriptor(file_descriptor&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  file_descriptor& operator=(file_descriptor&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~file_descriptor() { reset(); }
  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  void reset() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
};

// Reads a whole regular file. `role` names what it holds, for messages ("checkpoint"). A file
// that shrinks while being read returns what was there: its own format check decides.
inline std::vector<unsigned char> read_regular_file(const std::string& path, const char* argument,
                                                    const std::string& role) {
  const std::string expected = "an existing regular file holding a " + role;
  if (path.empty()) {
    throw file_error(argument, path, expected, "an empty path", "Pass the " + role + " file's path");
  }
  auto not_regular = [&](mode_t m) {
    return file_error(argument, path, expected, file_kind(m),
                      S_ISDIR(m) ? "Pass the " + role + " file inside that folder, not the folder"
                                 : "Pass a regular file; a " + role +
                                       " is not read from pipes or devices (copy it to a file)");
  };
  // stat first, so that a FIFO or a device is refused without being opened.
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int e = errno;
    throw file_error(argument, path, expected, errno_text(e), advice_for(e, false), e);
  }
  if (!S_ISREG(st.st_mode)) throw not_regular(st.st_mode);
  const file_descriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK));
  if (!fd) {
    const int e = errno;
    throw file_error(argument, path, expected, errno_text(e), advice_for(e, false), e);
  }
  if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) throw not_regular(st.st_mode);  // replaced meanwhile

  const auto size = static_cast<std::uint64_t>(st.st_size);
  std::vector<unsigned char> bytes;
  try {
    if (size > bytes.max_size()) throw std::bad_alloc();
    bytes.resize(static_cast<std::size_t>(size));
  } catch (const std::bad_alloc&) {
    throw_host_out_of_memory("read of '" + path + "'", static_cast<std::size_t>(size),
                             "the " + role + " file does not fit in host memory at once: free "
                             "host memory and read it again");
  }
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::read(fd.get(), bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int e = errno;
      throw file_error(argument, path, "a " + role + " file that can be read to its end",
                       "a read error after " + std::to_string(done) + " bytes: " + errno_text(e),
                       advice_for(e, false), e);
    }
    if (n == 0) break;
    done += static_cast<std::size_t>(n);
  }
  bytes.resize(done);
  return bytes;
}

// The base names of the temporaries this process is writing now, so that its own cleaner (same
// pid in the name) can tell them from leftovers of an earlier process that had the same pid.
class temporary_registry {
 public:
  static temporary_registry& instance() {
    static temporary_registry r;
    return r;
  }
  void add(const std::string& name) {
    const std::lock_guard<std::mutex> lock(mutex_);
    names_.insert(name);
  }
  void remove(const std::string& name) noexcept {
    const std::lock_guard<std::mutex> lock(mutex_);
    names_.erase(name);
  }
  bool contains(const std::string& name) const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return names_.count(name) != 0;
  }

 private:
  mutable std::mutex mutex_;
  std::set<std::string> names_;
};

// The file a symbolic link at `path` names (where an atomic write goes, and so its temporaries),
// or `path` itself.
inline std::string link_target(const std::string& path) {
  struct stat lst {};
  if (::lstat(path.c_str(), &lst) != 0 || !S_ISLNK(lst.st_mode)) return path;
  char* real = ::realpath(path.c_str(), nullptr);
  if (real == nullptr) return path;
  std::string out = real;
  std::free(real);
  return out;
}

// The pid in `<base>.tmp.<pid>` or `<base>.tmp.<pid>.<n>`, or 0 when `name` is not a temporary of
// `base` (another checkpoint's, or a file that merely starts alike).
inline pid_t temporary_pid(const std::string& name, const std::string& base) noexcept {
  const std::string prefix = base + ".tmp.";
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return 0;
  long long pid = 0;
  std::size_t i = prefix.size();
  for (; i < name.size() && name[i] >= '0' && name[i] <= '9'; ++i) {
    pid = pid * 10 + (name[i] - '0');
    if (pid > INT_MAX) return 0;
  }
  if (i == prefix.size()) return 0;
  if (i < name.size()) {  // an optional ".<n>"
    if (name[i] != '.' || i + 1 == name.size()) return 0;
    for (++i; i < name.size(); ++i)
      if (name[i] < '0' || name[i] > '9') return 0;
  }
  return static_cast<pid_t>(pid);
}

// Whether no process `pid` runs any more. A zombie counts as gone: a writer killed with -9 whose
// parent has not reaped it yet writes nothing.
inline bool process_gone(pid_t pid) noexcept {
  if (pid <= 0) return false;
  if (::kill(pid, 0) != 0) return errno == ESRCH;  // EPERM: alive, someone else's
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  const file_descriptor fd(::open(path, O_RDONLY | O_CLOEXEC));
  if (!fd) return false;
  char buf[512];
  const ssize_t n = ::read(fd.get(), buf, sizeof buf - 1);
  if (n <= 0) return false;
  buf[n] = '\0';
  // "pid (comm) S ...": the state follows the last ')', as comm may itself hold one.
  const char* close = std::strrchr(buf, ')');
  return close != nullptr && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X');
}

// Removes the temporaries `<path>.tmp.<pid>[.<n>]` that writers left when they were killed
// mid-write. One goes only when nobody can still be writing it:
//   * its pid is another process that is gone (kill(pid, 0) fails with ESRCH, or a zombie), or
//     this process but not one of the writes it has in flight (an earlier process had this pid);
//   * and its flock can be taken, which a live writer holds from creation to rename, also when
//     it runs in another pid namespace where its pid means nothing here.
// Temporaries of other files in the folder, symbolic links and non-regular files stay.
// Best effort: a folder that cannot be listed or a file that cannot be removed is left alone.
inline void remove_stale_temporaries(const std::string& given) noexcept {
  try {
    const std::string path = link_target(given);
    const std::string base = base_name(path);
    if (base.empty()) return;
    const std::unique_ptr<DIR, int (*)(DIR*)> dir(::opendir(parent_dir(path).c_str()), &::closedir);
    if (dir == nullptr) return;
    const int dfd = ::dirfd(dir.get());
    const pid_t self = ::getpid();
    std::vector<std::string> stale;
    while (const dirent* d = ::readdir(dir.get())) {
      const std::string name = d->d_name;
      const pid_t pid = temporary_pid(name, base);
      if (pid == 0) continue;
      if (pid != self && !process_gone(pid)) continue;
      stale.push_back(name);
    }
    temporary_registry& ours = temporary_registry::instance();
    for (const std::string& name : stale) {
      struct stat before {}, now {};
      if (::fstatat(dfd, name.c_str(), &before, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(before.st_mode))
        continue;
      const file_descriptor fd(
          ::openat(dfd, name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY));
      if (!fd || ::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) continue;  // a live writer holds it
      // Unlink only the file that was locked, not one created under the name since.
      if (::fstat(fd.get(), &now) == 0 && now.st_dev == before.st_dev && now.st_ino == before.st_ino &&
          ::fstatat(dfd, name.c_str(), &before, AT_SYMLINK_NOFOLLOW) == 0 &&
          before.st_ino == now.st_ino && before.st_dev == now.st_dev &&
          // Asked only now: a writer of this process registers the name before creating the
          // file, so a file of ours that exists is registered here, locked yet or not.
          !ours.contains(name)) {
        ::unlinkat(dfd, name.c_str(), 0);
      }
    }
  } catch (...) {
    // Only std::string and std::vector can throw here (out of memory): cleaning is optional.
  }
}

// A temporary being written: unlinked (unless renamed), closed and unregistered on every path.
class pending_temporary {
 public:
  pending_temporary() = default;
  pending_temporary(const pending_temporary&) = delete;
  pending_temporary& operator=(const pending_temporary&) = delete;
  ~pending_temporary() {
    if (!path_.empty() && !renamed_) ::unlink(path_.c_str());  // while still locked
    fd_.reset();
    if (registered_) temporary_registry::instance().remove(name_);
  }

  // Creates `<target>.tmp.<pid>.<n>` (O_EXCL, so never someone else's file) and locks it.
  // Returns errno, 0 on success.
  int create(const std::string& target) {
    static std::atomic<std::uint64_t> sequence{0};
    for (int attempt = 0; attempt < 64; ++attempt) {
      const std::string path = target + ".tmp." + std::to_string(::getpid()) + "." +
                               std::to_string(sequence.fetch_add(1));
      std::string name = base_name(path);
      temporary_registry::instance().add(name);  // before it exists: see the cleaner
      path_ = path;
      name_ = std::move(name);
      registered_ = true;
      const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
      if (fd < 0) {
        const int e = errno;
        forget();
        if (e == EEXIST) continue;  // a leftover of an earlier process with this pid
        return e;
      }
      fd_ = file_descriptor(fd);
      if (::flock(fd, LOCK_EX | LOCK_NB) == 0) return 0;
      // Only a cleaner that took it for a leftover can hold the lock: start over with a new name.
      ::unlink(path.c_str());
      fd_.reset();
      forget();
    }
    return EEXIST;
  }

  int fd() const noexcept { return fd_.get(); }
  const std::string& path() const noexcept { return path_; }
  void mark_renamed() noexcept { renamed_ = true; }

 private:
  void forget() noexcept {
    temporary_registry::instance().remove(name_);
    registered_ = false;
    path_.clear();
  }

  std::string path_, name_;  // name_: the base name, as registered
  file_descriptor fd_;
  bool registered_ = false;
  bool renamed_ = false;
};

// Writes `parts`, one after the other, as the file at `path`, atomically: a temporary in the same
// folder, fsync, rename over `path`, fsync of the folder. On any failure it throws file_error and
// the file at `path`, if any, is as it was. A symbolic link at `path` stays and the file it names
// is replaced. `path` must be absent or a regular file; a folder, FIFO or device is refused before
// anything is created.
inline void write_file_atomically(const std::string& path, const char* argument,
                                  const std::string& role, std::span<const byte_range> parts) {
  const std::string expected =
      "a path where a " + role + " file can be written (absent, or a regular file to replace)";
  const std::string unchanged = ". Any file already at the path is unchanged";
  auto fail = [&](const std::string& actual, int e, const std::string& what_to_do) {
    throw file_error(argument, path, expected, actual, what_to_do + unchanged, e);
  };
  if (path.empty()) fail("an empty path", 0, "Pass the " + role + " file's path");
  if (path.back() == '/') {
    fail("a path ending in '/', which names a folder", EISDIR, "Add the file's name after the '/'");
  }

  std::string target = path;
  mode_t keep_mode = 0;
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    if (!S_ISREG(st.st_mode)) {
      fail(file_kind(st.st_mode), S_ISDIR(st.st_mode) ? EISDIR : 0,
           S_ISDIR(st.st_mode) ? "Pass the path of a file inside that folder, not the folder"
                               : "Write to a regular file; pipes and devices cannot be replaced "
                                 "atomically");
    }
    keep_mode = st.st_mode & 07777;
    target = link_target(path);
  } else {
    const int e = errno;
    if (e != ENOENT) fail(errno_text(e), e, advice_for(e, true));
    // Name a missing folder plainly rather than through the temporary that could not be made.
    const std::string dir = parent_dir(path);
    struct stat dst {};
    if (::stat(dir.c_str(), &dst) != 0) {
      const int de = errno;
      fail("its folder '" + dir + "': " + errno_text(de), de, advice_for(de, true));
    }
    if (!S_ISDIR(dst.st_mode)) {
      fail("its folder '" + dir + "', which is " + file_kind(dst.st_mode), ENOTDIR,
           advice_for(ENOTDIR, true));
    }
  }

  remove_stale_temporaries(target);
  pending_temporary tmp;
  if (const int e = tmp.create(target); e != 0) {
    // The folder exists (checked above, or it holds the file): ENOENT here means it takes no new
    // files (/proc, /sys), not that a folder is missing.
    fail("no temporary file in its folder: " + errno_text(e), e,
         e == ENOENT ? "Its folder takes no new files (a virtual file system such as /proc or /sys): choose a path "
                       "on a regular file system"
                     : advice_for(e, true));
  }
  if (keep_mode != 0) (void)::fchmod(tmp.fd(), keep_mode);  // replacing keeps the permissions
  for (const byte_range& part : parts) {
    const auto* p = static_cast<const unsigned char*>(part.data);
    std::size_t done = 0;
    while (done < part.size) {
      const ssize_t w = ::write(tmp.fd(), p + done, part.size - done);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        const int e = w < 0 ? errno : ENOSPC;
        fail("a failed write to '" + tmp.path() + "': " + errno_text(e), e, advice_for(e, true));
      }
      done += static_cast<std::size_t>(w);
    }
  }
  if (::fsync(tmp.fd()) != 0) {
    const int e = errno;
    fail("a failed fsync of '" + tmp.path() + "': " + errno_text(e), e, advice_for(e, true));
  }
  if (::rename(tmp.path().c_str(), target.c_str()) != 0) {
    const int e = errno;
    fail("a failed rename of '" + tmp.path() + "' over it: " + errno_text(e), e,
         advice_for(e, true));
  }
  tmp.mark_renamed();
  const file_descriptor dfd(::open(parent_dir(target).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dfd) (void)::fsync(dfd.get());  // the rename is durable once the folder is synced
}

}  // namespace detail

MEMBOUND_NAMESPACE_END
