// Training machinery: AdamW against a plain double loop, the learning-rate schedule, clipping,
// the fp16 loss scaler, and checkpoint files (round trip, truncation, bit flips, atomicity).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "membound/optimizer/adamw.hpp"
#include "membound/train/checkpoint_file.hpp"
#include "membound/train/schedule_lr.hpp"

namespace mb = membound;

TEST_CASE("adamw: fp32 matches the textbook update in double; bf16 keeps fp32 masters") {
  mb::thread_pool pool(2);
  const std::size_t n = 5000;
  std::vector<float> w(n), g(n);
  for (std::size_t i = 0; i < n; ++i) {
    w[i] = std::sin(static_cast<float>(i));
    g[i] = std::cos(0.7f * static_cast<float>(i));
  }
  std::vector<double> rw(w.begin(), w.end()), m(n, 0.0), v(n, 0.0);
  std::vector<unsigned char> st(mb::adamw<float>::state_bytes(n));
  mb::adamw<float>::init(w.data(), n, st.data(), st.size());
  const mb::adamw_config c{1e-2, 0.9, 0.95, 1e-8, 0.1};
  for (std::uint64_t t = 1; t <= 3; ++t) {
    mb::adamw<float>::update(w.data(), g.data(), st.data(), n, 0, n, t, c.lr, c, true, 1.0, pool);
    for (std::size_t i = 0; i < n; ++i) {
      m[i] = 0.9 * m[i] + 0.1 * g[i];
      v[i] = 0.95 * v[i] + 0.05 * static_cast<double>(g[i]) * g[i];
      const double mh = m[i] / (1 - std::pow(0.9, static_cast<double>(t)));
      const double vh = v[i] / (1 - std::pow(0.95, static_cast<double>(t)));
      rw[i] -= c.lr * c.weight_decay * rw[i];
      rw[i] -= c.lr * mh / (std::sqrt(vh) + 1e-8);
    }
  }
  double err = 0;
  for (std::size_t i = 0; i < n; ++i) err = std::max(err, std::abs(w[i] - rw[i]));
  CHECK(err < 1e-5);  // fp32 moments: a few ulps of the ~1 weights over three steps

  // bf16: a step far below bf16's resolution still moves the master, so it adds up.
  std::vector<mb::bf16> wb(4, mb::bf16(1.0f)), gb(4, mb::bf16(1.0f));
  std::vector<unsigned char> sb(mb::adamw<mb::bf16>::state_bytes(4));
  CHECK(sb.size() == 3 * 4 * 4);
  mb::adamw<mb::bf16>::init(wb.data(), 4, sb.data(), sb.size());
  const mb::adamw_config tiny{1e-4, 0.9, 0.95, 1e-8, 0.0};
  for (std::uint64_t t = 1; t <= 100; ++t)
    mb::adamw<mb::bf16>::update(wb.data(), gb.data(), sb.data(), 4, 0, 4, t, tiny.lr, tiny, false, 1.0, pool);
  const float* master = reinterpret_cast<const float*>(sb.data()) + 8;
  CHECK(master[0] == doctest::Approx(1.0 - 100 * 1e-4).epsilon(1e-4));
  CHECK(static_cast<float>(wb[0]) < 1.0f);  // 0.99 rounds below 1 in bf16
}

TEST_CASE("cosine_lr: warm-up, peak, cosine to the floor") {
  const mb::cosine_lr lr{1e-3, 1e-4, 10, 110};
  CHECK(lr(0) == doctest::Approx(1e-4));
  CHECK(lr(9) == doctest::Approx(1e-3));
  CHECK(lr(10) == doctest::Approx(1e-3));
  CHECK(lr(60) == doctest::Approx(5.5e-4));
  CHECK(lr(110) == doctest::Approx(1e-4));
  CHECK(lr(1000) == doctest::Approx(1e-4));
}

TEST_CASE("global_norm and clip_factor; a NaN makes the norm non-finite") {
  mb::thread_pool pool(2);
  std::vector<float> g(40000, 0.0f);
  g[3] = 3.0f;
  g[39999] = 4.0f;
  CHECK(mb::global_norm(g.data(), g.size(), pool) == doctest::Approx(5.0));
  CHECK(mb::clip_factor(5.0, 1.0) == doctest::Approx(0.2));
  CHECK(mb::clip_factor(0.5, 1.0) == 1.0);
  g[100] = std::numeric_limits<float>::quiet_NaN();
  CHECK(!std::isfinite(mb::global_norm(g.data(), g.size(), pool)));
}

TEST_CASE("loss_scaler: an inf skips the step and halves; growth_interval clean steps double") {
  mb::loss_scaler s;
  s.scale = 1024;
  s.growth_interval = 3;
  CHECK(!s.update(std::numeric_limits<double>::infinity()));
  CHECK(s.scale == 512);
  CHECK(!s.update(std::numeric_limits<double>::quiet_NaN()));
  CHECK(s.scale == 256);
  CHECK(s.update(1.0));
  CHECK(s.update(1.0));
  CHECK(s.scale == 256);
  CHECK(s.update(1.0));
  CHECK(s.scale == 512);
}

TEST_CASE("checkpoint files: round trip; truncation and bit flips refused; failed writes keep the old file") {
  const auto dir = std::filesystem::temp_directory_path() / ("mb_ckpt_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "a.ckpt").string();
  std::vector<float> w{1.5f, -2.0f, 3.25f};
  mb::checkpoint_writer wr;
  wr.add("weights", w.data(), w.size() * sizeof(float));
  wr.add_value<std::uint64_t>("step", 42);
  wr.commit(path);

  mb::checkpoint_reader r(path);
  std::vector<float> back(3);
  r.copy("weights", back.data(), back.size() * sizeof(float));
  CHECK(back == w);
  CHECK(r.value<std::uint64_t>("step") == 42);
  CHECK_THROWS_AS(r.copy("weights", back.data(), 8), mb::corrupt_checkpoint);
  CHECK_THROWS_AS(r.value<int>("missing"), mb::corrupt_checkpoint);

  std::vector<char> bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  for (std::size_t cut : {std::size_t{0}, std::size_t{10}, bytes.size() / 2, bytes.size() - 1}) {
    CAPTURE(cut);
    const std::string t = (dir / "trunc.ckpt").string();
    std::ofstream(t, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(cut));
    CHECK_THROWS_AS(mb::checkpoint_reader{t}, mb::corrupt_checkpoint);
  }
  for (std::size_t at = 0; at < bytes.size(); at += 7) {
    CAPTURE(at);
    std::vector<char> flipped = bytes;
    flipped[at] = static_cast<char>(flipped[at] ^ 0x10);
    const std::string t = (dir / "flip.ckpt").string();
    std::ofstream(t, std::ios::binary).write(flipped.data(), static_cast<std::streamsize>(flipped.size()));
    CHECK_THROWS_AS(mb::checkpoint_reader{t}, mb::corrupt_checkpoint);
  }
  try {
    mb::checkpoint_reader missing((dir / "nope.ckpt").string());
    FAIL("a missing file was read");
  } catch (const mb::corrupt_checkpoint& e) {
    CHECK(std::string(e.what()).find("nope.ckpt") != std::string::npos);
  }

  // A write that cannot happen (the folder is gone) throws and leaves no temp file behind; the
  // good file elsewhere is untouched.
  mb::checkpoint_writer w2;
  w2.add_value<std::uint64_t>("step", 43);
  CHECK_THROWS_AS(w2.commit((dir / "no_such_dir" / "b.ckpt").string()), mb::error);
  CHECK(mb::checkpoint_reader(path).value<std::uint64_t>("step") == 42);
  w2.commit(path);  // overwrite atomically
  CHECK(mb::checkpoint_reader(path).value<std::uint64_t>("step") == 43);
  std::size_t files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) files += e.path().string().find(".tmp.") != std::string::npos;
  CHECK(files == 0);
  std::filesystem::remove_all(dir);
}
