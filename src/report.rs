//! What every benchmark shares: printing a table, writing JSON, and drawing a line chart
//! as SVG. Sizes and counts on the command line are [`crate::size`]'s.
//!
//! Benchmarks measure; this module only presents. It holds no timing code.

use std::fmt::Write as _;
use std::path::Path;

pub use strata_storage::format_bytes;

/// The process's peak resident memory (VmHWM in /proc/self/status), if known.
pub fn peak_rss_bytes() -> Option<u64> {
    vm_hwm("self")
}

/// Process `pid`'s peak resident memory so far (VmHWM), if it is running and says.
pub fn process_peak_rss_bytes(pid: u32) -> Option<u64> {
    vm_hwm(&pid.to_string())
}

/// VmHWM of /proc/`process`/status, in bytes.
fn vm_hwm(process: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{process}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The median of `values` (the mean of the middle two for an even count); NaN for none.
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => sorted[n / 2],
        _ => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// The index of the median of `values` (the lower middle one for an even count), to
/// report other figures of the median run.
pub fn median_index(values: &[f64]) -> usize {
    assert!(!values.is_empty(), "the median of nothing");
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[a].total_cmp(&values[b]));
    order[(values.len() - 1) / 2]
}

/// A table printed with aligned columns: numbers right-aligned, text left-aligned.
#[derive(Debug, Clone, Default)]
pub struct Table {
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column headers.
    pub fn new<S: Into<String>>(headers: impl IntoIterator<Item = S>) -> Self {
        Self {
            headers: headers.into_iter().map(Into::into).collect(),
            rows: Vec::new(),
        }
    }

    /// Appends a row; it must have one cell per header.
    pub fn row<S: Into<String>>(&mut self, cells: impl IntoIterator<Item = S>) {
        let row: Vec<String> = cells.into_iter().map(Into::into).collect();
        assert_eq!(
            row.len(),
            self.headers.len(),
            "a row needs one cell per column"
        );
        self.rows.push(row);
    }

    /// The table as text, one line per row, ending with a newline.
    pub fn render(&self) -> String {
        let widths: Vec<usize> = (0..self.headers.len())
            .map(|c| {
                self.rows
                    .iter()
                    .map(|r| r[c].chars().count())
                    .chain([self.headers[c].chars().count()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let numeric = |s: &str| {
            s.trim_end_matches(['x', '%'])
                .trim_start_matches(['-', '+'])
                .parse::<f64>()
                .is_ok()
        };
        let mut out = String::new();
        let line = |cells: &[String], out: &mut String| {
            let mut text = String::new();
            for (c, cell) in cells.iter().enumerate() {
                if c > 0 {
                    text.push_str("  ");
                }
                if numeric(cell) {
                    let _ = write!(text, "{cell:>w$}", w = widths[c]);
                } else {
                    let _ = write!(text, "{cell:<w$}", w = widths[c]);
                }
            }
            out.push_str(text.trim_end());
            out.push('\n');
        };
        line(&self.headers, &mut out);
        let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
        line(&rule, &mut out);
        for row in &self.rows {
            line(row, &mut out);
        }
        out
    }
}

/// Writes `value` as pretty-printed JSON to `path`, creating its parent folder.
pub fn write_json<T: serde::Serialize>(path: &Path, value: &T) -> std::io::Result<()> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    let text = serde_json::to_string_pretty(value).map_err(std::io::Error::other)?;
    std::fs::write(path, text + "\n")
}

/// One line of a chart: a name and its (x, y) points.
#[derive(Debug, Clone)]
pub struct Series {
    /// The name shown in the legend.
    pub name: String,
    /// The points, in the order they are joined.
    pub points: Vec<(f64, f64)>,
}

/// A line chart drawn as a self-contained SVG document.
#[derive(Debug, Clone)]
pub struct LineChart {
    /// The title above the plot.
    pub title: String,
    /// The label under the x axis.
    pub x_label: String,
    /// The label beside the y axis.
    pub y_label: String,
    /// Whether the x axis is logarithmic (base 2), as for sizes.
    pub log2_x: bool,
    /// How x values are written on the axis (for sizes: [`format_bytes`]).
    pub x_format: fn(f64) -> String,
    /// The lines.
    pub series: Vec<Series>,
}

impl LineChart {
    /// The chart as an SVG document. The y axis starts at zero.
    pub fn to_svg(&self) -> String {
        const W: f64 = 760.0;
        const H: f64 = 440.0;
        const LEFT: f64 = 70.0;
        const RIGHT: f64 = 180.0;
        const TOP: f64 = 40.0;
        const BOTTOM: f64 = 60.0;
        const COLORS: [&str; 8] = [
            "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
        ];
        let tx = |x: f64| {
            if self.log2_x {
                x.max(f64::MIN_POSITIVE).log2()
            } else {
                x
            }
        };
        let points = self.series.iter().flat_map(|s| s.points.iter());
        let (mut x_min, mut x_max, mut y_max) = (f64::INFINITY, f64::NEG_INFINITY, 0.0f64);
        for &(x, y) in points {
            x_min = x_min.min(tx(x));
            x_max = x_max.max(tx(x));
            y_max = y_max.max(y);
        }
        if !x_min.is_finite() {
            (x_min, x_max) = (0.0, 1.0);
        }
        if x_max <= x_min {
            x_max = x_min + 1.0;
        }
        let y_max = nice_ceiling(if y_max > 0.0 { y_max } else { 1.0 });
        let plot_w = W - LEFT - RIGHT;
        let plot_h = H - TOP - BOTTOM;
        let px = |x: f64| LEFT + (tx(x) - x_min) / (x_max - x_min) * plot_w;
        let py = |y: f64| TOP + plot_h - y / y_max * plot_h;

        let mut svg = String::new();
        let _ = writeln!(
            svg,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(svg, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="24" text-anchor="middle" font-size="15">{}</text>"#,
            LEFT + plot_w / 2.0,
            escape(&self.title)
        );
        for i in 0..=5 {
            let y = y_max * i as f64 / 5.0;
            let _ = writeln!(
                svg,
                r##"<line x1="{LEFT}" x2="{}" y1="{y0:.1}" y2="{y0:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
                LEFT + plot_w,
                LEFT - 6.0,
                py(y) + 4.0,
                trim_number(y),
                y0 = py(y),
            );
        }
        let mut ticks: Vec<f64> = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.0))
            .collect();
        ticks.sort_by(f64::total_cmp);
        ticks.dedup();
        let stride = ticks.len().div_ceil(10).max(1);
        for x in ticks.iter().step_by(stride) {
            let _ = writeln!(
                svg,
                r##"<line x1="{x0:.1}" x2="{x0:.1}" y1="{TOP}" y2="{}" stroke="#eee"/><text x="{x0:.1}" y="{}" text-anchor="middle">{}</text>"##,
                TOP + plot_h,
                TOP + plot_h + 16.0,
                escape(&(self.x_format)(*x)),
                x0 = px(*x),
            );
        }
        let _ = writeln!(
            svg,
            r#"<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="black"/>"#
        );
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
            LEFT + plot_w / 2.0,
            H - 16.0,
            escape(&self.x_label)
        );
        let _ = writeln!(
            svg,
            r#"<text transform="translate(18 {}) rotate(-90)" text-anchor="middle">{}</text>"#,
            TOP + plot_h / 2.0,
            escape(&self.y_label)
        );
        for (i, series) in self.series.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let path: Vec<String> = series
                .points
                .iter()
                .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
                .collect();
            let _ = writeln!(
                svg,
                r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#,
                path.join(" ")
            );
            for &(x, y) in &series.points {
                let _ = writeln!(
                    svg,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="2.5" fill="{color}"/>"#,
                    px(x),
                    py(y)
                );
            }
            let ly = TOP + 10.0 + 18.0 * i as f64;
            let lx = LEFT + plot_w + 12.0;
            let _ = writeln!(
                svg,
                r#"<line x1="{lx}" x2="{}" y1="{ly}" y2="{ly}" stroke="{color}" stroke-width="2"/><text x="{}" y="{}">{}</text>"#,
                lx + 18.0,
                lx + 24.0,
                ly + 4.0,
                escape(&series.name)
            );
        }
        svg.push_str("</svg>\n");
        svg
    }
}

fn nice_ceiling(value: f64) -> f64 {
    let magnitude = 10f64.powf(value.log10().floor());
    for step in [1.0, 2.0, 2.5, 5.0, 10.0] {
        if step * magnitude >= value {
            return step * magnitude;
        }
    }
    10.0 * magnitude
}

fn trim_number(value: f64) -> String {
    let text = format!("{value:.2}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_even_and_none() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
        assert_eq!(median_index(&[3.0, 1.0, 2.0]), 2);
        assert_eq!(median_index(&[4.0, 1.0, 2.0, 3.0]), 2);
    }

    #[test]
    fn formats_bytes() {
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(64 << 10), "64 KiB");
        assert_eq!(format_bytes(1536 << 20), "1.50 GiB");
    }

    #[test]
    fn table_aligns_columns() {
        let mut t = Table::new(["op", "GiB/s"]);
        t.row(["write", "4.31"]);
        t.row(["read", "10.5"]);
        let text = t.render();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "op     GiB/s");
        assert_eq!(lines[2], "write   4.31");
        assert_eq!(lines[3], "read    10.5");
    }

    #[test]
    fn chart_is_an_svg_with_every_series() {
        let chart = LineChart {
            title: "H2D <pinned>".into(),
            x_label: "size".into(),
            y_label: "GB/s".into(),
            log2_x: true,
            x_format: |x| format_bytes(x as u64),
            series: vec![
                Series {
                    name: "pinned".into(),
                    points: vec![(65536.0, 10.0), (1048576.0, 24.0)],
                },
                Series {
                    name: "pageable".into(),
                    points: vec![(65536.0, 3.0), (1048576.0, 9.0)],
                },
            ],
        };
        let svg = chart.to_svg();
        assert!(svg.starts_with("<svg"));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("H2D &lt;pinned&gt;"));
        assert!(svg.contains("64 KiB"));
    }
}
