// The trainer's checkpoint contents on their own (train/checkpoint_state.hpp), without a trainer:
//   - a file written by write_checkpoint_state reads back field for field (fingerprint, run
//     settings, weights, optimizer bytes, counters, the plan's choices, the tolerance);
//   - a file of another format is checkpoint_mismatch naming "format" with both values; counters
//     out of range are corrupt_checkpoint; a file from before the run settings and the tolerance
//     were recorded reads with none;
//   - a manifest names shard files beside it that tile the parameters (shard_of's ranges); one for
//     another parameter count is checkpoint_mismatch naming "parameters"; a gap, an overlap, a
//     world of 0 or a missing field is corrupt_checkpoint naming the manifest;
//   - a file read through a manifest must hold the parameters and world the manifest names it for;
//   - re-sharding copies the overlap of each optimizer array and nothing else;
//   - the shard files of a path that the committed checkpoint does not name are removed, and no
//     other file (temporaries, other paths' files).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "membound/train/checkpoint_state.hpp"

namespace mb = membound;

namespace {

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("membound_test_checkpoint_state_" + name)).string();
}

struct sample {
  std::vector<float> weights{1.5f, -2.0f, 0.25f};
  std::vector<std::byte> optimizer = std::vector<std::byte>(24, std::byte{7});
  mb::checkpoint_contents contents() const {
    mb::checkpoint_contents c;
    c.fingerprint = {{"config.width", "32"}, {"storage", "fp32"}};
    c.run_settings = {{"lr.peak", "0.01 (0x3f847ae147ae147b)"}, {"tag.data", "abc"}};
    c.weights = weights.data();
    c.weight_bytes = weights.size() * sizeof(float);
    c.optimizer = std::span<const std::byte>(optimizer);
    c.counters = {12, 11, 96, mb::random_state{0x1234}, 1024.0, 3};
    c.plan = {2, 2, 64, 1, 0};
    c.tolerated = {5000, 100, 1 << 20};
    return c;
  }
};

void write(const std::string& path, const mb::checkpoint_contents& c) {
  mb::checkpoint_writer cw;
  mb::write_checkpoint_state(cw, c);
  cw.commit(path);
}

}  // namespace

TEST_CASE("checkpoint state: what is written reads back, field for field") {
  const std::string path = temp_path("round_trip");
  const sample s;
  write(path, s.contents());
  const mb::checkpoint_reader r(path);
  mb::check_checkpoint_format(r, path);
  CHECK(mb::read_checkpoint_fields(r, "fingerprint", path) == s.contents().fingerprint);
  std::vector<float> w(3);
  r.copy("weights", w.data(), w.size() * sizeof(float));
  CHECK(w == s.weights);
  CHECK(r.size("optimizer") == s.optimizer.size());
  const mb::checkpoint_record c = mb::read_checkpoint_record(r, path);
  CHECK(c.counters.steps == 12);
  CHECK(c.counters.updates == 11);
  CHECK(c.counters.position == 96);
  CHECK(c.counters.rng == mb::random_state{0x1234});
  CHECK(c.counters.loss_scale == 1024.0);
  CHECK(c.counters.loss_scale_clean_steps == 3);
  CHECK(c.plan.micro_batch == 2);
  CHECK(c.plan.accumulation == 2);
  CHECK(c.plan.head_chunk == 64);
  CHECK(c.plan.schedule_kind == 1);
  CHECK(c.tolerated.peak == 5000);
  CHECK(c.tolerated.foreign == 100);
  CHECK(c.tolerated.limit == (1u << 20));
  CHECK(c.has_run_settings);
  CHECK(c.run_settings == s.contents().run_settings);
  std::filesystem::remove(path);
}

TEST_CASE("checkpoint state: another format, counters out of range and older files") {
  const std::string path = temp_path("refused");
  const sample s;
  SUBCASE("another format is checkpoint_mismatch naming format, with both values") {
    mb::checkpoint_writer cw;
    cw.add_value<std::uint64_t>("format", 1);
    cw.commit(path);
    const mb::checkpoint_reader r(path);
    try {
      mb::check_checkpoint_format(r, path);
      FAIL("format 1 was accepted");
    } catch (const mb::checkpoint_mismatch& e) {
      CHECK(e.field() == "format");
      CHECK(e.saved() == "1");
      CHECK(e.current() == std::to_string(mb::checkpoint_format_version));
    }
  }
  SUBCASE("more updates than steps, or a loss scale that is not a positive number") {
    for (int k = 0; k < 3; ++k) {
      mb::checkpoint_contents c = s.contents();
      if (k == 0) c.counters.updates = c.counters.steps + 1;
      if (k == 1) c.counters.loss_scale = 0;
      if (k == 2) c.counters.loss_scale = std::numeric_limits<double>::quiet_NaN();
      write(path, c);
      const mb::checkpoint_reader r(path);
      CHECK_THROWS_AS(mb::read_checkpoint_record(r, path), mb::corrupt_checkpoint);
    }
  }
  SUBCASE("a file without run settings or tolerance reads with none") {
    mb::checkpoint_writer cw;
    cw.add_value<std::uint64_t>("format", mb::checkpoint_format_version);
    const std::uint64_t pl[5] = {1, 4, 64, 0, 0};
    cw.add("plan", pl, sizeof pl);
    cw.add_value<std::uint64_t>("step", 3);
    cw.add_value<std::uint64_t>("updates", 3);
    cw.add_value<std::uint64_t>("rng", 9);
    cw.add_value<std::uint64_t>("data_position", 12);
    cw.add_value<double>("loss_scale", 1.0);
    cw.add_value<std::uint64_t>("loss_scale_clean_steps", 0);
    cw.commit(path);
    const mb::checkpoint_reader r(path);
    const mb::checkpoint_record c = mb::read_checkpoint_record(r, path);
    CHECK_FALSE(c.has_run_settings);
    CHECK(c.tolerated.peak == 0);
    CHECK(c.plan.accumulation == 4);
  }
  std::filesystem::remove(path);
}

TEST_CASE("checkpoint state: a manifest names shard files beside it that tile the parameters") {
  const std::filesystem::path folder = std::filesystem::temp_directory_path() / "membound_test_checkpoint_state_dir";
  std::filesystem::create_directories(folder);
  const std::string path = (folder / "run.ckpt").string();
  mb::write_checkpoint_manifest(path, 3, 7, 10);
  const mb::checkpoint_reader r(path);
  mb::check_checkpoint_format(r, path);
  const std::vector<mb::fingerprint_field> f = mb::read_checkpoint_manifest(r, path);
  CHECK(mb::manifest_value(f, "ranks", path) == "3");
  CHECK(mb::manifest_value(f, "step", path) == "7");
  const std::vector<mb::checkpoint_source> src = mb::manifest_sources(f, path, 10);
  REQUIRE(src.size() == 3);
  for (std::size_t k = 0; k < 3; ++k) {
    CHECK(src[k].range.begin == mb::shard_of(10, 3, k).begin);
    CHECK(src[k].range.end == mb::shard_of(10, 3, k).end);
    CHECK(src[k].file == mb::checkpoint_shard_path(path, 7, k, 3));
  }
  CHECK(mb::checkpoint_shard_path(path, 7, 1, 3) == (folder / "run.ckpt.step-7.rank-1-of-3").string());

  try {
    (void)mb::manifest_sources(f, path, 11);
    FAIL("a manifest of 10 parameters was taken for 11");
  } catch (const mb::checkpoint_mismatch& e) {
    CHECK(e.field() == "parameters");
    CHECK(e.saved() == "10");
    CHECK(e.current() == "11");
  }
  const auto edited = [&](const std::string& name, const std::string& value) {
    std::vector<mb::fingerprint_field> g = f;
    for (mb::fingerprint_field& e : g)
      if (e.name == name) e.value = value;
    return g;
  };
  CHECK_THROWS_AS(mb::manifest_sources(edited("ranks", "0"), path, 10), mb::corrupt_checkpoint);
  CHECK_THROWS_AS(mb::manifest_sources(edited("ranks", "x"), path, 10), mb::corrupt_checkpoint);
  CHECK_THROWS_AS(mb::manifest_sources(edited("shard.1", "5..7 run.ckpt.step-7.rank-1-of-3"), path, 10),
                  mb::corrupt_checkpoint);  // a gap after shard 0's [0, 4)
  CHECK_THROWS_AS(mb::manifest_sources(edited("shard.1", "4..7"), path, 10), mb::corrupt_checkpoint);  // no file
  CHECK_THROWS_AS(mb::manifest_sources(edited("ranks", "4"), path, 10), mb::corrupt_checkpoint);  // no shard.3
  CHECK_THROWS_AS(mb::manifest_value(f, "zero3", path), mb::corrupt_checkpoint);
  std::filesystem::remove_all(folder);
}

TEST_CASE("checkpoint state: a file read through a manifest holds what the manifest names it for") {
  const std::vector<mb::fingerprint_field> shard1 = {{"config.width", "32"}, {"ranks", "2"}, {"optimizer.shard", "5..10"}};
  mb::check_source_identity(shard1, {{5, 10}, "b"}, 2, 10, "m");  // as named: nothing thrown
  try {
    mb::check_source_identity(shard1, {{0, 5}, "a"}, 2, 10, "m");  // shard 1 copied over shard 0
    FAIL("a shard file named for another rank's parameters was taken");
  } catch (const mb::corrupt_checkpoint& e) {
    const std::string w = e.what();
    CHECK(w.find("holds parameters 5..10 of a world of 2") != std::string::npos);
    CHECK(w.find("names it for 0..5 of 2") != std::string::npos);
  }
  CHECK_THROWS_AS(mb::check_source_identity(shard1, {{5, 10}, "b"}, 4, 10, "m"), mb::corrupt_checkpoint);  // another world
  // A whole checkpoint records no shard: all the parameters, one rank.
  const std::vector<mb::fingerprint_field> whole = {{"config.width", "32"}};
  mb::check_source_identity(whole, {{0, 10}, "w"}, 1, 10, "m");
  CHECK_THROWS_AS(mb::check_source_identity(whole, {{0, 5}, "w"}, 2, 10, "m"), mb::corrupt_checkpoint);
}

TEST_CASE("checkpoint state: re-sharding copies the overlap of each optimizer array, nothing else") {
  // Three arrays of 4-byte elements; element value: array·1000 + parameter index.
  constexpr std::size_t arrays = 3, eb = sizeof(std::uint32_t);
  const auto state_of = [&](mb::shard_range r) {
    std::vector<std::uint32_t> v(arrays * r.size());
    for (std::size_t a = 0; a < arrays; ++a)
      for (std::size_t i = r.begin; i < r.end; ++i) v[a * r.size() + (i - r.begin)] = static_cast<std::uint32_t>(a * 1000 + i);
    return v;
  };
  const auto bytes = [](const std::vector<std::uint32_t>& v) { return std::as_bytes(std::span<const std::uint32_t>(v)); };
  const auto writable = [](std::vector<std::uint32_t>& v) { return std::as_writable_bytes(std::span<std::uint32_t>(v)); };
  const std::uint32_t untouched = 0xdeadbeef;
  for (const auto& [from, to] : std::vector<std::pair<mb::shard_range, mb::shard_range>>{
           {{4, 10}, {0, 7}}, {{0, 4}, {0, 7}}, {{0, 10}, {3, 6}}, {{3, 6}, {0, 10}}, {{7, 10}, {0, 7}}}) {
    const std::vector<std::uint32_t> src = state_of(from);
    std::vector<std::uint32_t> dst(arrays * to.size(), untouched);
    mb::copy_state_overlap(bytes(src), from, writable(dst), to, arrays, eb);
    const mb::shard_range o = mb::overlap(to, from.begin, from.end);
    for (std::size_t a = 0; a < arrays; ++a)
      for (std::size_t i = to.begin; i < to.end; ++i) {
        const bool in = i >= o.begin && i < o.end && o.size() != 0;
        CHECK(dst[a * to.size() + (i - to.begin)] == (in ? a * 1000 + i : untouched));
      }
  }
}

TEST_CASE("checkpoint state: shard files no committed checkpoint names are removed, nothing else") {
  CHECK(mb::is_checkpoint_shard_name("run.ckpt.step-12.rank-0-of-2", "run.ckpt"));
  CHECK_FALSE(mb::is_checkpoint_shard_name("run.ckpt.step-12.rank-0-of-2.tmp.123", "run.ckpt"));  // a writer's temporary
  CHECK_FALSE(mb::is_checkpoint_shard_name("run.ckpt.step-12.rank-0-of-", "run.ckpt"));
  CHECK_FALSE(mb::is_checkpoint_shard_name("run.ckpt.step-x.rank-0-of-2", "run.ckpt"));
  CHECK_FALSE(mb::is_checkpoint_shard_name("other.ckpt.step-1.rank-0-of-2", "run.ckpt"));
  CHECK_FALSE(mb::is_checkpoint_shard_name("run.ckpt", "run.ckpt"));

  namespace fs = std::filesystem;
  const fs::path folder = temp_path("cleanup");
  fs::remove_all(folder);
  fs::create_directories(folder);
  const std::string path = (folder / "run.ckpt").string();
  const std::vector<std::string> all = {"run.ckpt.step-4.rank-0-of-2", "run.ckpt.step-4.rank-1-of-2",  // an earlier step
                                        "run.ckpt.step-8.rank-0-of-4", "run.ckpt.step-8.rank-3-of-4",  // another world
                                        "run.ckpt.step-8.rank-0-of-2", "run.ckpt.step-8.rank-1-of-2",  // the manifest's
                                        "run.ckpt.step-8.rank-0-of-2.tmp.1",    // a live writer's temporary
                                        "run.ckpt.step-9.rank-1-of-2.tmp.2147483646",  // a dead writer's
                                        "other.ckpt.step-9.rank-1-of-2.tmp.2147483646",  // another path's
                                        "run.ckpt", "other.ckpt.step-4.rank-0-of-2", "notes.txt"};
  for (const std::string& f : all) std::ofstream(folder / f) << "x";
  const std::vector<std::string> keep = {mb::checkpoint_shard_path(path, 8, 0, 2), mb::checkpoint_shard_path(path, 8, 1, 2)};
  CHECK(mb::remove_unreferenced_shards(path, keep) == 4);
  std::vector<std::string> left;
  for (const fs::directory_entry& e : fs::directory_iterator(folder)) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  // The dead writer's temporary of a shard goes (a killed save's; no later save writes that name
  // again); a live writer's (pid 1 never ends) and another checkpoint's stay.
  CHECK(left == std::vector<std::string>{"notes.txt", "other.ckpt.step-4.rank-0-of-2",
                                         "other.ckpt.step-9.rank-1-of-2.tmp.2147483646", "run.ckpt",
                                         "run.ckpt.step-8.rank-0-of-2", "run.ckpt.step-8.rank-0-of-2.tmp.1",
                                         "run.ckpt.step-8.rank-1-of-2"});
  CHECK(mb::remove_unreferenced_shards(path, keep) == 0);  // again: nothing more
  CHECK(mb::remove_unreferenced_shards(path, {}) == 2);    // a whole checkpoint names none
  fs::remove_all(folder);
}
