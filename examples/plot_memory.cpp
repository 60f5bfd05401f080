// plot_memory: draws a membound memory trace (trace_recorder::save_chrome_trace, train --trace)
// as an SVG: memory by tag stacked over time against the budget, the pressure thresholds, the
// planner's predicted peak and the pressure changes the monitor saw. No plotting library: the
// SVG is a few hundred elements written here, so the tool builds wherever the trainer builds.
//
//   plot_memory --trace trace.json --report report.json --out memory.svg
//   plot_memory --trace trace.json --budget 32MiB --thresholds 0.9,0.95,0.97 --out memory.svg
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "cli_checks.hpp"
#include "membound/core/error.hpp"

namespace mb = membound;
using json = nlohmann::json;

namespace {

// Bottom of the stack first: the long-lived tags (and "other", which is mostly memory held by
// others, steady between steps) form a flat base, and the per-step saw-tooth of activations and
// workspace sits on top where it is easy to read. No red or orange among them: those colours
// belong to the budget and the thresholds.
constexpr std::array<std::string_view, 6> tag_names{"weights", "gradients",   "optimizer",
                                                    "other",   "activations", "workspace"};
constexpr std::array<std::string_view, 6> tag_colours{"#4e79a7", "#59a14f", "#edc948",
                                                      "#bab0ac", "#b07aa1", "#76b7b2"};
constexpr std::size_t tag_count = tag_names.size();
constexpr double mib = 1024.0 * 1024.0;
constexpr std::size_t max_points = 4000, max_markers = 300;

// Canvas and plot area in pixels; the right margin holds the labels of the horizontal lines.
constexpr double width = 960, height = 480;
constexpr double left = 72, right = 790, top = 62, bottom = 428;

struct sample {  // times in microseconds, as in the trace
  double t = 0, total = 0;
  std::array<double, tag_count> bytes{};
};
struct pressure_event {
  double t = 0;
  std::string level, check_point;
};
struct trace_data {
  std::vector<sample> samples;
  std::vector<pressure_event> pressure;
  double t_first = HUGE_VAL, t_last = -HUGE_VAL;
};
struct report_data {
  std::optional<double> budget, predicted_peak;
  std::optional<std::array<double, 3>> thresholds;
};

json read_json(const std::string& path, const std::string& flag, const std::string& what_to_do) {
  std::string text;
  try {  // libstdc++ throws from the read itself when the path is a directory
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error("cannot open");
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  } catch (const std::exception&) {
    throw mb::invalid_argument(flag, "a readable JSON file", "'" + path + "'", what_to_do);
  }
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw mb::invalid_argument(flag, "valid JSON", "'" + path + "': " + e.what(), what_to_do);
  }
}

// A byte count as the trainer writes one: a whole number from 0 to 2^64 - 1. 1e300, 0.5 or -1
// is no count of bytes: a file that holds one was not written by membound, or was damaged.
bool byte_count(double b) {
  return b >= 0 && b < 18446744073709551616.0 && std::floor(b) == b;  // 2^64 exactly is out; NaN fails every test
}

trace_data load_trace(const std::string& path) {
  const std::string fix = "Pass a trace written by train --trace or trace_recorder::save_chrome_trace";
  const json doc = read_json(path, "--trace", fix);
  trace_data d;
  try {
    for (const json& e : doc.at("traceEvents")) {
      const std::string ph = e.value("ph", "");
      if (ph == "M" || !e.contains("ts")) continue;  // metadata has no place on a time axis
      const double t = e.at("ts").get<double>();
      d.t_first = std::min(d.t_first, t);
      d.t_last = std::max(d.t_last, t);
      const std::string name = e.value("name", "");
      if (ph == "C" && name == "memory by tag") {
        sample s{t, 0, {}};
        for (const auto& [key, value] : e.at("args").items()) {
          // A tag unknown here (a newer trace) goes to "other" so the total stays right.
          const auto k = static_cast<std::size_t>(std::find(tag_names.begin(), tag_names.end(), key) - tag_names.begin());
          const double b = value.get<double>();
          if (!byte_count(b)) {
            throw mb::invalid_argument("--trace", "byte counts: whole numbers from 0 to 2^64 - 1",
                                       "'" + path + "': " + key + " = " + value.dump(), fix);
          }
          s.bytes[std::min(k, tag_count - 1)] += b;
        }
        for (double b : s.bytes) s.total += b;
        d.samples.push_back(s);
      } else if (ph == "i" && e.value("cat", "") == "pressure") {
        const json args = e.value("args", json::object());
        // "pressure emergency" -> "emergency" when args.to is missing.
        d.pressure.push_back({t, args.value("to", name.substr(name.rfind(' ') + 1)), args.value("check_point", "")});
      }
    }
  } catch (const json::exception& e) {
    throw mb::invalid_argument("--trace", "Chrome trace-event JSON from membound's trace_recorder",
                               "'" + path + "': " + e.what(), fix);
  }
  if (d.samples.empty()) {
    throw mb::invalid_argument("--trace", "at least one \"memory by tag\" counter event", "none in '" + path + "'",
                               "Record through a traced_allocator so allocations are counted");
  }
  std::stable_sort(d.samples.begin(), d.samples.end(), [](const sample& a, const sample& b) { return a.t < b.t; });
  return d;
}

std::array<double, 3> checked_thresholds(const std::array<double, 3>& t, const std::string& flag,
                                         const std::string& text) {
  if (!(t[0] > 0 && t[0] <= t[1] && t[1] <= t[2] && t[2] <= 1)) {  // also refuses NaN
    throw mb::invalid_argument(flag, "warning <= critical <= emergency, fractions in (0, 1]", text,
                               "e.g. --thresholds 0.90,0.95,0.97");
  }
  return t;
}

report_data load_report(const std::string& path) {
  const std::string fix = "Pass the report written by train --report, or give --budget instead";
  const json doc = read_json(path, "--report", fix);
  report_data r;
  try {
    // A value that is there must be usable: a report that says 0 or -1 is not silently ignored.
    if (doc.contains("budget_bytes")) r.budget = doc.at("budget_bytes").get<double>();
    if (r.budget && !(*r.budget > 0 && byte_count(*r.budget))) {
      throw mb::invalid_argument("--report", "a budget_bytes from 1 to 2^64 - 1, a whole number",
                                 "'" + path + "': " + doc.at("budget_bytes").dump(), fix);
    }
    if (doc.contains("predicted_peak_bytes")) r.predicted_peak = doc.at("predicted_peak_bytes").get<double>();
    if (r.predicted_peak && !byte_count(*r.predicted_peak)) {
      throw mb::invalid_argument("--report", "a predicted_peak_bytes from 0 to 2^64 - 1, a whole number",
                                 "'" + path + "': " + doc.at("predicted_peak_bytes").dump(), fix);
    }
    if (doc.contains("thresholds")) {
      const json& t = doc.at("thresholds");
      r.thresholds = checked_thresholds(
          {t.at("warning").get<double>(), t.at("critical").get<double>(), t.at("emergency").get<double>()},
          "--report", "thresholds " + t.dump());
    }
  } catch (const json::exception& e) {
    throw mb::invalid_argument("--report", "numeric budget_bytes, predicted_peak_bytes and thresholds",
                               "'" + path + "': " + e.what(), fix);
  }
  return r;
}

// Three fractions "warning,critical,emergency", each read as strictly as train's numbers.
std::array<double, 3> parse_thresholds(const std::string& s) {
  std::array<double, 3> t{};
  std::size_t at = 0, i = 0;
  for (; i < 3 && at <= s.size(); ++i) {
    const std::size_t comma = std::min(s.find(',', at), s.size());
    t[i] = cli_checks::real("--thresholds", s.substr(at, comma - at), 0, 1, true, "--thresholds 0.90,0.95,0.97");
    at = comma + 1;
  }
  if (i != 3 || at != s.size() + 1) {
    throw mb::invalid_argument("--thresholds", "three fractions warning,critical,emergency", "'" + s + "'",
                               "e.g. --thresholds 0.90,0.95,0.97");
  }
  return checked_thresholds(t, "--thresholds", "'" + s + "'");
}

// fixed() for coordinates and sizes; short_number() for tick labels and percentages (0.3, 97.5).
std::string fixed(double v, int decimals = 1) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}
std::string short_number(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

// Text for the SVG: XML's three specials escaped, and control characters XML 1.0 forbids dropped.
std::string escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c == '&') out += "&amp;";
    else if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (static_cast<unsigned char>(c) >= 0x20 || c == '\t' || c == '\n') out += c;
  }
  return out;
}

std::string line(double x1, double y1, double x2, double y2, const std::string& style) {
  return "<line x1=\"" + fixed(x1) + "\" y1=\"" + fixed(y1) + "\" x2=\"" + fixed(x2) + "\" y2=\"" + fixed(y2) +
         "\" " + style + "/>";
}

std::string text(double x, double y, std::string_view content, const std::string& style) {
  return "<text x=\"" + fixed(x) + "\" y=\"" + fixed(y) + "\" " + style + ">" + escape(content) + "</text>";
}

// 1, 2 or 5 times a power of ten, giving about `target` ticks over `range`.
double nice_step(double range, double target) {
  const double raw = range / target, magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  return (raw / magnitude < 1.5 ? 1 : raw / magnitude < 3 ? 2 : raw / magnitude < 7 ? 5 : 10) * magnitude;
}

// More points than pixels only bloats the file. Per pixel column keep the sample with the largest
// total, at its own time, so no peak is lost, and the column's last sample, so the step after the
// column starts from the right value.
std::vector<sample> downsample(const std::vector<sample>& s, double t0, double span) {
  if (s.size() <= max_points) return s;
  const auto column = [&](double t) { return static_cast<long>((t - t0) / span * (right - left)); };
  std::vector<sample> out;
  for (std::size_t i = 0; i < s.size();) {
    std::size_t last = i, best = i;
    while (last + 1 < s.size() && column(s[last + 1].t) == column(s[i].t)) {
      if (s[++last].total > s[best].total) best = last;
    }
    out.push_back(s[best]);
    if (last != best) out.push_back(s[last]);
    i = last + 1;
  }
  return out;
}

std::size_t severity(std::string_view level) {
  return level == "emergency" ? 3 : level == "critical" ? 2 : level == "warning" ? 1 : 0;
}

// The threshold lines' colours, so a marker reads as "crossed that line"; green is back to normal.
std::string level_colour(std::string_view level) {
  static const std::array<std::string, 4> colours{"#2ca02c", "#f5a623", "#e8590c", "#d62728"};
  return colours[severity(level)];
}

struct hline {
  double bytes;
  std::string label, colour, style;
};

std::string render_svg(const trace_data& d, double budget, const std::array<double, 3>& thresholds,
                       std::optional<double> predicted_peak, const std::string& title, double peak) {
  const double t0 = d.t_first;
  const double span = std::max(d.t_last - t0, 1000.0);  // µs; a lone sample still gets an axis
  const double y_max = std::max({budget, peak, predicted_peak.value_or(0.0)}) * 1.05;
  const auto x_of = [&](double t) { return left + (t - t0) / span * (right - left); };
  const auto y_of = [&](double bytes) { return bottom - bytes / y_max * (bottom - top); };
  const std::string w = fixed(width, 0), h = fixed(height, 0);
  std::string o = "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + w + "\" height=\"" + h +
                  "\" viewBox=\"0 0 " + w + " " + h + "\" font-family=\"sans-serif\" font-size=\"11\">\n" +
                  "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n" +
                  text(left, 26, title, "font-size=\"16\" font-weight=\"bold\" fill=\"#222\"") + "\n";

  // Legend in one row under the title; tags that never hold a byte are left out.
  std::array<bool, tag_count> used{};
  for (const sample& s : d.samples)
    for (std::size_t k = 0; k < tag_count; ++k) used[k] = used[k] || s.bytes[k] > 0;
  double lx = left;
  for (std::size_t k = 0; k < tag_count; ++k) {
    if (!used[k]) continue;
    o += "<rect x=\"" + fixed(lx) + "\" y=\"38\" width=\"11\" height=\"11\" fill=\"" + std::string(tag_colours[k]) +
         "\"/>" + text(lx + 15, 48, tag_names[k], "font-size=\"12\" fill=\"#333\"") + "\n";
    lx += 33 + 7.0 * static_cast<double>(tag_names[k].size());  // ~7 px a character at 12 px
  }

  // Grid and ticks: y in MiB, x in seconds since the first event.
  const double y_step = nice_step(y_max / mib, 6), span_s = span / 1e6, x_step = nice_step(span_s, 8);
  for (int i = 0; i * y_step <= y_max / mib; ++i) {
    const double y = y_of(i * y_step * mib);
    o += line(left, y, right, y, "stroke=\"#e5e5e5\"") +
         text(left - 6, y + 4, short_number(i * y_step), "text-anchor=\"end\" fill=\"#444\"") + "\n";
  }
  for (int i = 0; i * x_step <= span_s * (1 + 1e-9); ++i) {
    const double x = left + i * x_step / span_s * (right - left);
    o += line(x, bottom, x, bottom + 5, "stroke=\"#444\"") +
         text(x, bottom + 18, short_number(i * x_step), "text-anchor=\"middle\" fill=\"#444\"") + "\n";
  }
  o += text((left + right) / 2, bottom + 38, "time since first event (s)",
            "text-anchor=\"middle\" font-size=\"12\" fill=\"#333\"") +
       "\n<text transform=\"translate(18," + fixed((top + bottom) / 2) +
       ") rotate(-90)\" text-anchor=\"middle\" font-size=\"12\" fill=\"#333\">memory (MiB)</text>\n";

  // Pressure changes: per pixel column the most severe one, thinned further if still too many.
  // Drawn behind the areas so they never hide memory, with a solid tick above the plot that
  // stays visible where the areas cover the line.
  std::vector<const pressure_event*> markers;
  for (const pressure_event& p : d.pressure) {
    if (markers.empty() || std::lround(x_of(p.t)) != std::lround(x_of(markers.back()->t))) markers.push_back(&p);
    else if (severity(p.level) > severity(markers.back()->level)) markers.back() = &p;
  }
  for (std::size_t i = 0; i < markers.size(); i += markers.size() / max_markers + 1) {
    const pressure_event& p = *markers[i];
    const double x = x_of(p.t);
    o += "<g stroke=\"" + level_colour(p.level) + "\"><title>pressure " + escape(p.level) + " at " +
         fixed((p.t - t0) / 1e6, 3) + " s " + escape(p.check_point) + "</title>" +
         line(x, top, x, bottom, "stroke-opacity=\"0.5\"") + line(x, top - 6, x, top, "stroke-width=\"1.5\"") +
         "</g>\n";
  }

  // Stacked areas as step functions: a value holds until the next sample, the last until the end.
  const std::vector<sample> s = downsample(d.samples, t0, span);
  for (std::size_t k = 0; k < tag_count; ++k) {
    if (!used[k]) continue;
    const auto step = [&](std::size_t i, bool upper, bool forward) {
      double v = 0;
      for (std::size_t j = 0; j < k + (upper ? 1 : 0); ++j) v += s[i].bytes[j];
      const std::string y = "," + fixed(y_of(v)) + " ";
      const std::string x0 = fixed(x_of(s[i].t)), x1 = fixed(x_of(i + 1 < s.size() ? s[i + 1].t : t0 + span));
      return forward ? x0 + y + x1 + y : x1 + y + x0 + y;
    };
    std::string points;  // along the top of this tag's band, then back along its bottom
    for (std::size_t i = 0; i < s.size(); ++i) points += step(i, true, true);
    for (std::size_t i = s.size(); i-- > 0;) points += step(i, false, false);
    points.pop_back();
    const std::string c(tag_colours[k]);
    o += "<polygon fill=\"" + c + "\" stroke=\"" + c + "\" stroke-width=\"0.5\" points=\"" + points +
         "\"><title>" + std::string(tag_names[k]) + "</title></polygon>\n";
  }

  // Horizontal lines, labelled in the right margin. Labels are pushed 13 px apart, since the
  // thresholds of a budget are often only a few pixels from each other.
  const auto pct = [](double f) { return short_number(f * 100) + "%"; };
  const std::string dashed = "stroke-dasharray=\"6 4\"";
  std::vector<hline> lines{{budget, "budget " + fixed(budget / mib) + " MiB", "#d62728", "stroke-width=\"1.5\""},
                           {thresholds[0] * budget, "warning " + pct(thresholds[0]), "#f5a623", dashed},
                           {thresholds[1] * budget, "critical " + pct(thresholds[1]), "#e8590c", dashed},
                           {thresholds[2] * budget, "emergency " + pct(thresholds[2]), "#d62728", dashed},
                           {peak, "measured peak " + fixed(peak / mib) + " MiB", "#222", "stroke-width=\"0.75\""}};
  if (predicted_peak) {
    lines.push_back({*predicted_peak, "predicted peak " + fixed(*predicted_peak / mib) + " MiB", "#555",
                     "stroke-dasharray=\"8 3\""});
  }
  std::sort(lines.begin(), lines.end(), [](const hline& a, const hline& b) { return a.bytes > b.bytes; });
  std::vector<double> label_y(lines.size());
  for (std::size_t i = 0; i < lines.size(); ++i)
    label_y[i] = i == 0 ? y_of(lines[i].bytes) : std::max(y_of(lines[i].bytes), label_y[i - 1] + 13);
  for (std::size_t i = lines.size(); i-- > 0;)  // then back up from the bottom if pushed past it
    label_y[i] = std::min(label_y[i], i + 1 == lines.size() ? height - 8 : label_y[i + 1] - 13);
  for (std::size_t i = 0; i < lines.size(); ++i) {
    const hline& l = lines[i];
    const double y = y_of(l.bytes);
    o += line(left, y, right, y, "stroke=\"" + l.colour + "\" " + l.style) +
         line(right, y, right + 6, label_y[i], "stroke=\"" + l.colour + "\"") +
         text(right + 9, label_y[i] + 4, l.label, "fill=\"" + l.colour + "\"") + "\n";
  }
  return o + line(left, top, left, bottom, "stroke=\"#444\"") + line(left, bottom, right, bottom, "stroke=\"#444\"") +
         "\n</svg>\n";
}

}  // namespace

int main(int argc, char** argv) {
  namespace cc = cli_checks;
  CLI::App app{"plot_memory: draw a membound memory trace as an SVG (memory by tag against the budget)"};
  std::string trace_path, report_path, budget_text, thresholds_text, title = "memory by tag", out_path;
  app.add_option("--trace", trace_path, "Chrome trace JSON from train --trace")->required()->type_name("FILE");
  app.add_option("--report", report_path, "report JSON from train --report: budget, thresholds, predicted peak")
      ->type_name("FILE");
  app.add_option("--budget", budget_text, "budget, the same units as train --budget, e.g. 32MiB (default: the "
                                          "report's budget_bytes)")
      ->type_name("SIZE");
  app.add_option("--thresholds", thresholds_text, "warning,critical,emergency fractions in (0, 1], in that order "
                                                  "(default: the report's, or 0.90,0.95,0.97)")
      ->type_name("W,C,E");
  app.add_option("--title", title, "plot title");
  app.add_option("--out", out_path, "SVG file to write (its folder must exist)")->required()->type_name("FILE");
  try {
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      if (e.get_exit_code() == 0) return app.exit(e);  // --help
      throw std::runtime_error(std::string(e.what()) + "; run plot_memory --help for the options");
    }
    // The numbers first, then the files: the inputs can be read, the output can be written and
    // is neither input, all before anything is drawn.
    const bool report_given = app.count("--report") > 0;
    std::optional<double> budget_flag;
    if (app.count("--budget")) budget_flag = static_cast<double>(cc::size("--budget", budget_text, "--budget 32MiB"));
    const std::optional<std::array<double, 3>> thresholds_flag =
        app.count("--thresholds") ? std::optional(parse_thresholds(thresholds_text)) : std::nullopt;
    cc::input_file("--trace", trace_path, "Pass a trace written by train --trace");
    if (report_given) cc::input_file("--report", report_path, "Pass a report written by train --report");
    cc::output_file("--out", out_path);
    cc::distinct("--out", out_path, "--trace", trace_path);
    if (report_given) cc::distinct("--out", out_path, "--report", report_path);

    const trace_data trace = load_trace(trace_path);
    const report_data report = report_given ? load_report(report_path) : report_data{};
    if (!budget_flag && !report.budget) {
      throw mb::invalid_argument("--budget", "a budget from --budget or the report's budget_bytes",
                                 report_given ? "none in '" + report_path + "'" : "neither given",
                                 "Pass --budget 32MiB or --report REPORT.json from train --report");
    }
    const double budget = budget_flag ? *budget_flag : *report.budget;
    const std::array<double, 3> thresholds =
        thresholds_flag ? *thresholds_flag : report.thresholds.value_or(std::array<double, 3>{0.90, 0.95, 0.97});
    double peak = 0;
    for (const sample& s : trace.samples) peak = std::max(peak, s.total);

    const std::string svg = render_svg(trace, budget, thresholds, report.predicted_peak, title, peak);
    cc::write_file("--out", out_path, [&](std::ostream& f) { f << svg; });
    std::printf("wrote %s: %zu samples, peak %.1f MiB of %.1f MiB budget\n", out_path.c_str(),
                trace.samples.size(), peak / mib, budget / mib);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", cc::one_line(e.what()).c_str());  // one line, whatever a library wrote
    return 1;
  }
}
