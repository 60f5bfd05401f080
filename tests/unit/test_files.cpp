// Files the library opens itself. Every path that cannot serve (a folder, a missing file or
// folder, no permission, an empty file, a FIFO, a device, a socket, a symlink loop, a full disk)
// is one typed file_error naming the path, for reading (checkpoint_reader) and for both writers
// (checkpoint_writer::commit, trace_recorder::save_chrome_trace); a failed write leaves the old
// file and no temporary. Temporaries of killed writers go on the next save or load, and only
// those whose writer is gone.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <set>
#include <string>
#include <typeinfo>
#include <vector>

#include "membound/core/file_io.hpp"
#include "membound/memory/trace.hpp"
#include "membound/train/checkpoint_file.hpp"

namespace mb = membound;
namespace fs = std::filesystem;

namespace {

// A fresh folder in the temp directory, removed at the end.
struct temp_dir {
  fs::path path;
  temp_dir() {
    std::string t = (fs::temp_directory_path() / "mb_files_XXXXXX").string();
    REQUIRE(::mkdtemp(t.data()) != nullptr);
    path = t;
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

std::vector<unsigned char> read_bytes(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_bytes(const std::string& p, const std::vector<unsigned char>& b) {
  std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(b.data()),
                                           static_cast<std::streamsize>(b.size()));
}

// A checkpoint whose every payload float equals its step, so a reader can tell a whole file.
void save_step(const std::string& path, std::uint64_t step, std::size_t floats = 1000) {
  mb::checkpoint_writer w;
  w.add_value("step", step);
  const std::vector<float> x(floats, static_cast<float>(step));
  w.add("x", x.data(), x.size() * sizeof(float));
  w.commit(path);
}
std::uint64_t load_step(const std::string& path, std::size_t floats = 1000) {
  const mb::checkpoint_reader r(path);
  const auto step = r.value<std::uint64_t>("step");
  std::vector<float> x(floats);
  r.copy("x", x.data(), x.size() * sizeof(float));
  std::size_t wrong = 0;
  for (float v : x) wrong += v != static_cast<float>(step);
  REQUIRE(wrong == 0);
  return step;
}

// Names of the atomic writers' temporaries anywhere under `dir`.
std::set<std::string> temporaries(const fs::path& dir) {
  std::set<std::string> out;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, fs::directory_options::skip_permission_denied, ec);
       it != fs::recursive_directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.find(".tmp.") != std::string::npos) out.insert(name);
  }
  return out;
}

// Runs f, which must throw E naming `path` with what was expected and what to do. A std
// exception or another membound error escaping fails the check.
template <typename E, typename F>
bool refused(F&& f, const std::string& path) {
  try {
    f();
  } catch (const E& e) {
    const std::string what = e.what();
    CHECK(e.path() == path);
    CHECK(e.argument() == "path");
    CHECK(what.find("'" + path + "'") != std::string::npos);
    CHECK_FALSE(e.expected().empty());
    CHECK_FALSE(e.actual().empty());
    CHECK_FALSE(e.what_to_do().empty());
    return true;
  } catch (const std::exception& e) {
    FAIL_CHECK("escaped " << typeid(e).name() << ": " << e.what());
    return false;
  }
  FAIL_CHECK("accepted");
  return false;
}

// The same in a child process (no doctest there): whether f threw E naming path.
template <typename E, typename F>
bool refused_quietly(F&& f, const std::string& path) {
  try {
    f();
  } catch (const E& e) {
    return e.path() == path && std::string(e.what()).find(path) != std::string::npos;
  } catch (...) {
  }
  return false;
}

// Runs f in a child process after `setup`; returns 0 when f returned true, 1 when false.
int in_child(const std::function<bool()>& f, const std::function<void()>& setup) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    setup();
    bool ok = false;
    try {
      ok = f();
    } catch (...) {
    }
    ::_exit(ok ? 0 : 1);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// The same without root's exemption from file permissions (as nobody when this runs as root);
// 77 when the privileges could not be dropped.
int unprivileged(const std::function<bool()>& f) {
  return in_child(f, [] {
    if (::geteuid() == 0 &&
        (::setgroups(0, nullptr) != 0 || ::setgid(65534) != 0 || ::setuid(65534) != 0)) {
      ::_exit(77);
    }
  });
}

void make_socket(const std::string& p) {
  const int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
  REQUIRE(s >= 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  REQUIRE(p.size() < sizeof a.sun_path);
  std::memcpy(a.sun_path, p.c_str(), p.size() + 1);
  REQUIRE(::bind(s, reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0);
  ::close(s);
}

// The paths that no reader or writer can use, made in `d`: label, path.
std::vector<std::pair<std::string, std::string>> unusable_paths(const temp_dir& d) {
  fs::create_directory(d.path / "folder");
  write_bytes(d / "plain.txt", {'h', 'i'});
  REQUIRE(::mkfifo((d / "fifo").c_str(), 0644) == 0);
  make_socket(d / "sock");
  fs::create_symlink("loop", d.path / "loop");
  fs::create_symlink(d.path / "folder", d.path / "link_to_folder");
  // A device only when it is one: were /dev/null ever missing or a plain file, a test writing
  // there would create or replace it for the whole machine.
  REQUIRE_MESSAGE(fs::is_character_file(fs::status("/dev/null")),
                  "/dev/null is not a character device on this machine: restore it "
                  "(mknod -m 666 /dev/null c 1 3)");
  return {
      {"a folder", d / "folder"},
      {"a folder, with a trailing slash", d / "folder/"},
      {"a symbolic link to a folder", d / "link_to_folder"},
      {"in a missing folder", d / "no_such_folder/x.bin"},
      {"in a folder that is a file", d / "plain.txt/x.bin"},
      {"an empty path", ""},
      {"a FIFO", d / "fifo"},
      {"a character device", "/dev/null"},
      {"a socket", d / "sock"},
      {"a symbolic link loop", d / "loop"},
      {"a name too long", d / std::string(300, 'n')},
  };
}

using saver = std::function<void(const std::string&)>;
const std::vector<std::pair<std::string, saver>>& writers() {
  static const std::vector<std::pair<std::string, saver>> w = {
      {"checkpoint_writer::commit", [](const std::string& p) { save_step(p, 7); }},
      {"trace_recorder::save_chrome_trace",
       [](const std::string& p) {
         mb::trace_recorder r(64);
         for (int i = 0; i < 40; ++i) r.mark("mark " + std::to_string(i));
         r.save_chrome_trace(p);
       }},
  };
  return w;
}

}  // namespace

TEST_CASE("files: the checkpoint reader refuses every path that is not a readable checkpoint") {
  temp_dir d;
  auto cases = unusable_paths(d);
  write_bytes(d / "empty.ckpt", {});
  write_bytes(d / "magic_only.ckpt", {'M', 'B', 'C', 'K', 'P', 'T', 0, 1});
  fs::create_symlink(d.path / "gone.ckpt", d.path / "dangling");
  cases.insert(cases.end(), {
                                {"a missing file", d / "missing.ckpt"},
                                {"a dangling symbolic link", d / "dangling"},
                                {"an empty file", d / "empty.ckpt"},
                                {"a truncated file", d / "magic_only.ckpt"},
                                {"an endless device", fs::is_character_file(fs::status("/dev/zero"))
                                                          ? "/dev/zero" : "/dev/null"},
                                {"a file given with a trailing slash", d / "empty.ckpt/"},
                            });
  int refusals = 0;
  for (const auto& [label, path] : cases) {
    CAPTURE(label);
    refusals += refused<mb::corrupt_checkpoint>([&] { mb::checkpoint_reader r(path); }, path);
  }
  CHECK(refusals == static_cast<int>(cases.size()));

  // The messages say what was found.
  auto message = [](const std::string& p) {
    try {
      mb::checkpoint_reader r(p);
    } catch (const mb::corrupt_checkpoint& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(message(d / "folder").find("got a directory") != std::string::npos);
  try {
    mb::checkpoint_reader r(d / "folder");
  } catch (const mb::corrupt_checkpoint& e) {
    CHECK(e.actual() == "a directory");
    CHECK(e.expected().find("regular file") != std::string::npos);
    CHECK(e.error_number() == 0);
  }
  try {
    mb::checkpoint_reader r(d / "missing.ckpt");
  } catch (const mb::corrupt_checkpoint& e) {
    CHECK(e.error_number() == ENOENT);
  }
  CHECK(message(d / "folder").find("not the folder") != std::string::npos);
  CHECK(message(d / "fifo").find("FIFO") != std::string::npos);
  CHECK(message("/dev/null").find("character device") != std::string::npos);
  CHECK(message(d / "missing.ckpt").find("No such file") != std::string::npos);
  CHECK(message(d / "empty.ckpt").find("empty") != std::string::npos);
  // One catch covers every file problem; corrupt_checkpoint stays an error for older callers.
  CHECK_THROWS_AS(mb::checkpoint_reader(d / "folder"), mb::file_error);
  CHECK_THROWS_AS(mb::checkpoint_reader(d / "folder"), mb::invalid_argument);
  CHECK_THROWS_AS(mb::checkpoint_reader(d / "folder"), mb::error);

  // A file this user may not read (as nobody when the test runs as root).
  save_step(d / "secret.ckpt", 1);
  fs::permissions(d.path, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                              fs::perms::others_read | fs::perms::others_exec);
  fs::permissions(d / "secret.ckpt", fs::perms::none);
  const std::string secret = d / "secret.ckpt";
  const int rc = unprivileged([&] {
    return refused_quietly<mb::corrupt_checkpoint>([&] { mb::checkpoint_reader r(secret); }, secret);
  });
  if (rc == 77) {
    MESSAGE("cannot drop root privileges here: the unreadable-file case is skipped");
  } else {
    CHECK(rc == 0);
  }
  fs::permissions(d / "secret.ckpt", fs::perms::owner_read | fs::perms::owner_write);
  CHECK(load_step(secret) == 1);
}

TEST_CASE("files: both writers refuse every unusable path, create nothing and change nothing") {
  for (const auto& [writer, save] : writers()) {
    CAPTURE(writer);
    temp_dir d;
    const auto cases = unusable_paths(d);
    for (const auto& [label, path] : cases) {
      CAPTURE(label);
      CHECK(refused<mb::file_error>([&] { save(path); }, path));
    }
    // Nothing was replaced or created: the folder, FIFO, socket and device are what they were.
    CHECK(fs::is_directory(fs::symlink_status(d.path / "folder")));
    CHECK(fs::is_empty(d.path / "folder"));
    CHECK(fs::is_fifo(fs::symlink_status(d.path / "fifo")));
    CHECK(fs::is_socket(fs::symlink_status(d.path / "sock")));
    CHECK(fs::is_character_file(fs::status("/dev/null")));
    CHECK(fs::is_symlink(fs::symlink_status(d.path / "link_to_folder")));
    CHECK_FALSE(fs::exists(d.path / "no_such_folder"));
    CHECK(read_bytes(d / "plain.txt") == std::vector<unsigned char>{'h', 'i'});
    CHECK(temporaries(d.path).empty());

    // The messages name what was found and what to do.
    try {
      save(d / "folder");
    } catch (const mb::file_error& e) {
      CHECK(e.actual() == "a directory");
      CHECK(std::string(e.what()).find("unchanged") != std::string::npos);
    }
    try {
      save(d / "no_such_folder/x.bin");
    } catch (const mb::file_error& e) {
      CHECK(e.actual().find("no_such_folder") != std::string::npos);
      CHECK(e.what_to_do().find("Create the folder") != std::string::npos);
      CHECK(e.error_number() == ENOENT);
    }
  }
}

TEST_CASE("files: a write refused by permissions or a full disk keeps the old file and no temporary") {
  for (const auto& [writer, save] : writers()) {
    CAPTURE(writer);
    temp_dir d;
    const std::string path = d / "out.bin";
    save(path);
    const auto before = read_bytes(path);
    REQUIRE(before.size() > 100);

    // A folder this user may not write to (r-x for all; as nobody when the test runs as root).
    fs::permissions(d.path, fs::perms::owner_read | fs::perms::owner_exec | fs::perms::group_read |
                                fs::perms::group_exec | fs::perms::others_read |
                                fs::perms::others_exec);
    const std::string fresh = d / "fresh.bin";
    auto save_one = save;  // the child gets its own copy
    int rc = unprivileged([&] {
      return refused_quietly<mb::file_error>([&] { save_one(path); }, path) &&
             refused_quietly<mb::file_error>([&] { save_one(fresh); }, fresh);
    });
    if (rc == 77) {
      MESSAGE("cannot drop root privileges here: the read-only folder case is skipped");
    } else {
      CHECK(rc == 0);
    }
    CHECK_FALSE(fs::exists(fresh));

    // A write that fails part way (RLIMIT_FSIZE stands in for a full disk).
    fs::permissions(d.path, fs::perms::owner_all);
    rc = in_child(
        [&] {
          try {
            if (writer == "checkpoint_writer::commit") {
              save_step(path, 9, 100000);  // 400 kB, over the limit
            } else {
              mb::trace_recorder r(4096);
              for (int i = 0; i < 4000; ++i) r.mark("a mark of some length " + std::to_string(i));
              r.save_chrome_trace(path);
            }
          } catch (const mb::file_error& e) {
            return e.path() == path && e.error_number() == EFBIG;
          }
          return false;
        },
        [] {
          ::signal(SIGXFSZ, SIG_IGN);
          const rlimit lim{64 * 1024, 64 * 1024};
          ::setrlimit(RLIMIT_FSIZE, &lim);
        });
    CHECK(rc == 0);
    CHECK(read_bytes(path) == before);
    CHECK(temporaries(d.path).empty());
  }
}

namespace {
// A child that has exited and been reaped: its pid names no process (until the system reuses it).
pid_t dead_pid() {
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) ::_exit(0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return pid;
}
}  // namespace

TEST_CASE("files: saving through a symbolic link replaces the file it names; permissions are kept") {
  for (const auto& [writer, save] : writers()) {
    CAPTURE(writer);
    temp_dir d;
    fs::create_directory(d.path / "real");
    save(d / "real/out.bin");
    fs::create_symlink(d.path / "real/out.bin", d.path / "link.bin");
    fs::permissions(d / "real/out.bin", fs::perms::owner_read | fs::perms::owner_write);
    write_bytes(d / "real/out.bin", {'o', 'l', 'd'});
    // A killed writer's temporary lies beside the file the link names, where writes go.
    const std::string stale = "out.bin.tmp." + std::to_string(dead_pid());
    write_bytes(d / ("real/" + stale), {'s'});
    save(d / "link.bin");
    CHECK_FALSE(fs::exists(d.path / "real" / stale));
    CHECK(fs::is_symlink(fs::symlink_status(d.path / "link.bin")));
    CHECK(read_bytes(d / "real/out.bin").size() > 3);
    CHECK((fs::status(d.path / "real/out.bin").permissions() & fs::perms::all) ==
          (fs::perms::owner_read | fs::perms::owner_write));
    CHECK(temporaries(d.path).empty());
    if (writer == "checkpoint_writer::commit") {  // and a read through the link cleans there too
      write_bytes(d / ("real/" + stale), {'s'});
      CHECK(load_step(d / "link.bin") == 7);
      CHECK_FALSE(fs::exists(d.path / "real" / stale));
    }
  }
}


TEST_CASE("files: the next save or load removes exactly the temporaries whose writer is gone") {
  temp_dir d;
  const std::string ckpt = d / "a.ckpt", trace = d / "t.json";
  save_step(ckpt, 5);

  // A live writer: a child that waits on a pipe.
  int pipe_fds[2];
  REQUIRE(::pipe(pipe_fds) == 0);
  std::fflush(nullptr);
  const pid_t live = ::fork();
  REQUIRE(live >= 0);
  if (live == 0) {
    ::close(pipe_fds[1]);
    char c;
    while (::read(pipe_fds[0], &c, 1) > 0) {
    }
    ::_exit(0);
  }
  ::close(pipe_fds[0]);
  // A zombie: exited, not reaped yet.
  const pid_t zombie = ::fork();
  REQUIRE(zombie >= 0);
  if (zombie == 0) ::_exit(0);
  siginfo_t info{};
  REQUIRE(::waitid(P_PID, static_cast<id_t>(zombie), &info, WEXITED | WNOWAIT) == 0);
  const std::string dead = std::to_string(dead_pid()), self = std::to_string(::getpid());

  // Kept whatever happens: another file's temporaries, names that only look alike, a symlink and
  // a folder with a temporary's name, a live writer's file, one locked by a writer whose pid
  // means nothing here (another pid namespace), and one of this process's writes in flight.
  const std::vector<std::string> kept = {
      "b.ckpt.tmp." + dead,      "xa.ckpt.tmp." + dead,    "a.ckpt.tmp." + dead + ".x",
      "a.ckpt.tmp.",             "a.ckpt.tmpfile",         "a.ckpt.tmp.0",
      "a.ckpt.tmp.99999999999",  "a.ckpt.tmp." + dead + ".", "a.ckpt.tmp.-" + dead,
      "a.ckpt.tmp." + dead + ".1.2", "a.ckpt.tmp." + std::to_string(live),
      "a.ckpt.tmp." + std::to_string(live) + ".3", "a.ckpt.tmp." + dead + ".locked",
      "t.json.tmp." + std::to_string(live) + ".0",
  };
  const std::string locked = "a.ckpt.tmp." + dead + ".77", in_flight = "a.ckpt.tmp." + self + ".424242";
  const std::string link = "a.ckpt.tmp." + dead + ".8", folder = "a.ckpt.tmp." + dead + ".9";
  // Removed: the dead writer's (old and new name forms), the zombie's, and one left by an earlier
  // process that had this pid.
  const std::vector<std::string> stale_ckpt = {
      "a.ckpt.tmp." + dead, "a.ckpt.tmp." + dead + ".0", "a.ckpt.tmp." + std::to_string(zombie) + ".5",
      "a.ckpt.tmp." + self + ".999999"};
  const std::vector<std::string> stale_trace = {"t.json.tmp." + dead + ".2"};

  auto plant = [&] {
    for (const auto& n : kept) write_bytes(d / n, {'k'});
    for (const auto& n : stale_ckpt) write_bytes(d / n, {'s'});
    for (const auto& n : stale_trace) write_bytes(d / n, {'s'});
    write_bytes(d / locked, {'l'});
    write_bytes(d / in_flight, {'f'});
    write_bytes(d / "outside", {'o'});
    std::error_code ec;
    fs::create_symlink(d.path / "outside", d.path / link, ec);
    fs::create_directory(d.path / folder, ec);
  };
  const int lock_fd = [&] {
    plant();
    const int fd = ::open((d / locked).c_str(), O_RDONLY);
    REQUIRE(fd >= 0);
    REQUIRE(::flock(fd, LOCK_EX) == 0);
    return fd;
  }();
  mb::detail::temporary_registry::instance().add(in_flight);

  auto check_after = [&](const std::vector<std::string>& gone, const std::vector<std::string>& still) {
    for (const auto& n : gone) {
      CAPTURE(n);
      CHECK_FALSE(fs::exists(fs::symlink_status(d.path / n)));
    }
    for (const auto& n : still) {
      CAPTURE(n);
      CHECK(fs::exists(fs::symlink_status(d.path / n)));
    }
    for (const auto& n : kept) {
      CAPTURE(n);
      CHECK(read_bytes(d / n) == std::vector<unsigned char>{'k'});
    }
    CHECK(read_bytes(d / locked) == std::vector<unsigned char>{'l'});
    CHECK(read_bytes(d / in_flight) == std::vector<unsigned char>{'f'});
    CHECK(fs::is_symlink(fs::symlink_status(d.path / link)));
    CHECK(fs::is_directory(d.path / folder));
    CHECK(read_bytes(d / "outside") == std::vector<unsigned char>{'o'});
  };

  SUBCASE("a load") {
    CHECK(load_step(ckpt) == 5);
    check_after(stale_ckpt, stale_trace);  // the trace's temporaries are another file's
  }
  SUBCASE("a save") {
    save_step(ckpt, 6);
    CHECK(load_step(ckpt) == 6);
    check_after(stale_ckpt, stale_trace);
  }
  SUBCASE("a trace save") {
    mb::trace_recorder r(4);
    r.mark("m");
    r.save_chrome_trace(trace);
    check_after(stale_trace, stale_ckpt);
  }
  SUBCASE("a load that fails still cleans") {
    write_bytes(ckpt, {'b', 'a', 'd'});
    CHECK_THROWS_AS(mb::checkpoint_reader{ckpt}, mb::corrupt_checkpoint);
    check_after(stale_ckpt, stale_trace);
  }

  mb::detail::temporary_registry::instance().remove(in_flight);
  ::close(lock_fd);
  ::close(pipe_fds[1]);
  int status = 0;
  ::waitpid(live, &status, 0);
  ::waitpid(zombie, &status, 0);
}

TEST_CASE("files: the temporary-name parser takes only <base>.tmp.<pid>[.<n>]") {
  using mb::detail::temporary_pid;
  CHECK(temporary_pid("a.ckpt.tmp.123", "a.ckpt") == 123);
  CHECK(temporary_pid("a.ckpt.tmp.123.0", "a.ckpt") == 123);
  CHECK(temporary_pid("a.ckpt.tmp.2147483647.9", "a.ckpt") == 2147483647);
  for (const char* n : {"a.ckpt.tmp.", "a.ckpt.tmp.2147483648", "a.ckpt.tmp.0", "a.ckpt.tmp.1.",
                        "a.ckpt.tmp..1", "a.ckpt.tmp.1.2.3", "a.ckpt.tmp.1a", "a.ckpt.tmp.+1",
                        "b.ckpt.tmp.1", "a.ckpt", "a.ckpt.tmp", "A.ckpt.tmp.1", "a.ckpt.tmp. 1"}) {
    CAPTURE(n);
    CHECK(temporary_pid(n, "a.ckpt") == 0);
  }
  CHECK(mb::detail::process_gone(::getpid()) == false);
  CHECK(mb::detail::process_gone(dead_pid()));
}

TEST_CASE("files: writers killed mid-save leave a whole checkpoint; the next load clears their temporaries") {
  temp_dir d;
  const std::string path = d / "run.ckpt";
  constexpr std::size_t floats = 1 << 18;  // 1 MiB payload
  save_step(path, 0, floats);
  std::size_t leftovers = 0;
  for (int round = 0; round < 12; ++round) {
    CAPTURE(round);
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      try {
        for (std::uint64_t s = 1;; ++s) save_step(path, s, floats);
      } catch (...) {
      }
      ::_exit(1);
    }
    ::usleep(static_cast<useconds_t>(1000 + 2700 * (round % 7)));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    leftovers += temporaries(d.path).size();
    (void)load_step(path, floats);  // whole, whichever step it holds
    CHECK(temporaries(d.path).empty());
  }
  MESSAGE("temporaries left by 12 killed writers, all removed: " << leftovers);
}
