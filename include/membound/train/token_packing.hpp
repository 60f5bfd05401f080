// Variable-length samples packed into rows of a token budget instead of padded or truncated to
// one length (one part of the trainer, train/trainer.hpp). A row holds `seq` tokens in at most
// `sequences` sequences laid end to end (what a packed batch_shape{rows, seq, sequences} plans
// for); the layers run each sequence alone, so packing changes no result, only the padding.
//
//   const membound::token_packing pack(lengths, 512, 16);   // samples' token counts
//   pack.write(r, [&](std::size_t i) { return std::span(sample_ids[i]); }, row);  // in a packed_source
//
// Best-fit decreasing: samples longest first, each into the fullest row that still has room for
// it (its tokens and a sequence slot), a new row when none has. A sample longer than a row is cut
// into row-long pieces first (each its own sequence: the only cut context); a sample of fewer than
// 2 tokens has no next-token target and is left out. Deterministic: ties keep the samples' order.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "membound/core/config.hpp"
#include "membound/core/error.hpp"
#include "membound/shape/lm_head_shape.hpp"
#include "membound/train/data_source.hpp"

MEMBOUND_NAMESPACE_BEGIN

// Tokens [begin, begin + length) of sample `sample`: one sequence of a row.
struct token_piece {
  std::size_t sample = 0;
  std::size_t begin = 0;
  std::size_t length = 0;
};

class token_packing {
 public:
  // lengths: each sample's token count. seq: tokens per row (at least 2); sequences: the most a
  // row holds (at least 1). Throws invalid_argument naming the argument otherwise.
  token_packing(std::span<const std::size_t> lengths, std::size_t seq, std::size_t sequences)
      : seq_(seq), sequences_(sequences), lengths_(lengths.begin(), lengths.end()) {
    if (seq < 2) {
      throw invalid_argument("seq", "at least 2 tokens per row", std::to_string(seq),
                             "A row needs a token and its next-token target");
    }
    if (sequences == 0) throw invalid_argument("sequences", "at least 1 per row", "0", "Let a row hold a sequence");
    // Pieces: every sample cut into row-long parts (most are one part), longest first.
    std::vector<token_piece> pieces;
    for (std::size_t i = 0; i < lengths.size(); ++i) {
      if (lengths[i] < 2) continue;  // no target to learn
      for (std::size_t b = 0; b < lengths[i]; b += seq) pieces.push_back({i, b, std::min(seq, lengths[i] - b)});
      tokens_ += lengths[i];
    }
    std::stable_sort(pieces.begin(), pieces.end(),
                     [](const token_piece& a, const token_piece& b) { return a.length > b.length; });
    // Rows with room, by free tokens: the least room that takes a piece is the best fit.
    std::multimap<std::size_t, std::size_t> open;  // free tokens -> row
    std::vector<std::vector<token_piece>> rows;
    std::vector<std::size_t> used;
    for (const token_piece& p : pieces) {
      auto it = open.lower_bound(p.length);
      std::size_t r;
      if (it == open.end()) {
        r = rows.size();
        rows.emplace_back();
        used.push_back(0);
      } else {
        r = it->second;
        open.erase(it);
      }
      rows[r].push_back(p);
      used[r] += p.length;
      if (used[r] < seq && rows[r].size() < sequences) open.emplace(seq - used[r], r);
    }
    // Flattened: row r's pieces are pieces_[first_[r], first_[r + 1]), in the order placed.
    first_.push_back(0);
    for (const auto& row : rows) {
      pieces_.insert(pieces_.end(), row.begin(), row.end());
      first_.push_back(pieces_.size());
    }
  }

  std::size_t rows() const noexcept { return first_.size() - 1; }
  std::size_t seq() const noexcept { return seq_; }
  std::size_t sequences() const noexcept { return sequences_; }
  // Row r's pieces, each one sequence of it (r < rows()).
  std::span<const token_piece> row(std::size_t r) const noexcept {
    return {pieces_.data() + first_[r], first_[r + 1] - first_[r]};
  }
  // The samples' tokens (those of at least 2), and the rows' tokens no sample fills.
  std::size_t tokens() const noexcept { return tokens_; }
  std::size_t padding() const noexcept { return rows() * seq_ - tokens_; }
  // Of the rows' tokens, the share that is data: 1 − padding / (rows · seq).
  double efficiency() const noexcept {
    return rows() == 0 ? 1.0 : static_cast<double>(tokens_) / static_cast<double>(rows() * seq_);
  }

  // Writes row r into `out` (out.seq = seq(), out.sequences = sequences()). sample(i) gives sample
  // i's token ids (a span of exactly its length). Each piece's targets are the sample's next
  // ids; the sample's last token gets ignore_target (its next token is another sample's). The
  // row's padding is `pad` ids with ignore_target, a sequence of its own when a slot is free,
  // else at the end of the last sequence: every layer is causal, so no data token sees it.
  // Unused sequences are empty (their offsets repeat seq).
  template <typename Samples>
  void write(std::size_t r, Samples&& sample, const packed_row& out, std::int32_t pad = 0) const {
    if (r >= rows()) {
      throw invalid_argument("row", "an index below rows() = " + std::to_string(rows()), std::to_string(r),
                             "Ask for a row of this packing");
    }
    if (out.seq != seq_ || out.sequences != sequences_) {
      throw invalid_argument("out", "a packed_row of " + std::to_string(seq_) + " tokens and " +
                                        std::to_string(sequences_) + " sequences (this packing's)",
                             std::to_string(out.seq) + " tokens, " + std::to_string(out.sequences) + " sequences",
                             "Pack for the trainer's effective batch_shape{rows, seq, sequences}");
    }
    std::size_t t = 0, k = 0;
    out.offsets[0] = 0;
    for (const token_piece& p : row(r)) {
      const auto ids = sample(p.sample);
      if (ids.size() != lengths_[p.sample]) {
        throw invalid_argument("sample(" + std::to_string(p.sample) + ")",
                               std::to_string(lengths_[p.sample]) + " ids (the length it was packed with)",
                               std::to_string(ids.size()) + " ids", "Give write() the samples the packing was made of");
      }
      for (std::size_t j = 0; j < p.length; ++j) {
        const std::size_t at = p.begin + j;
        out.tokens[t + j] = static_cast<std::int32_t>(ids[at]);
        out.targets[t + j] = at + 1 < ids.size() ? static_cast<std::int32_t>(ids[at + 1]) : ignore_target;
      }
      t += p.length;
      out.offsets[++k] = static_cast<std::int32_t>(t);
    }
    if (t < seq_) {
      for (; t < seq_; ++t) {
        out.tokens[t] = pad;
        out.targets[t] = ignore_target;
      }
      if (k < sequences_) ++k;
      out.offsets[k] = static_cast<std::int32_t>(seq_);
    }
    for (++k; k <= sequences_; ++k) out.offsets[k] = static_cast<std::int32_t>(seq_);
  }

 private:
  std::size_t seq_ = 0, sequences_ = 0, tokens_ = 0;
  std::vector<std::size_t> lengths_;
  std::vector<token_piece> pieces_;
  std::vector<std::size_t> first_;
};

MEMBOUND_NAMESPACE_END
