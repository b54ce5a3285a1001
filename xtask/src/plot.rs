//! Small, dependency-free SVG charts for the benchmark report: CDF lines,
//! grouped bars and time series. Enough to read a result at a glance,
//! nothing more.

use std::fmt::Write as _;

const W: f64 = 640.0;
const H: f64 = 360.0;
const LEFT: f64 = 64.0;
const RIGHT: f64 = 150.0;
const TOP: f64 = 36.0;
const BOTTOM: f64 = 48.0;
const COLORS: [&str; 6] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
];

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn frame(out: &mut String, title: &str, x_label: &str, y_label: &str) {
    let _ = write!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">
<rect width="{W}" height="{H}" fill="white"/>
<text x="{}" y="20" text-anchor="middle" font-size="14">{}</text>
<text x="{}" y="{}" text-anchor="middle">{}</text>
<text x="14" y="{}" text-anchor="middle" transform="rotate(-90 14 {})">{}</text>
<line x1="{LEFT}" y1="{}" x2="{}" y2="{}" stroke="black"/>
<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{}" stroke="black"/>
"#,
        (W - RIGHT + LEFT) / 2.0,
        escape(title),
        (W - RIGHT + LEFT) / 2.0,
        H - 10.0,
        escape(x_label),
        (H - BOTTOM + TOP) / 2.0,
        (H - BOTTOM + TOP) / 2.0,
        escape(y_label),
        H - BOTTOM,
        W - RIGHT,
        H - BOTTOM,
        H - BOTTOM,
    );
}

fn legend(out: &mut String, names: &[&str]) {
    for (i, n) in names.iter().enumerate() {
        let y = TOP + 10.0 + 18.0 * i as f64;
        let _ = writeln!(
            out,
            r#"<rect x="{}" y="{}" width="12" height="12" fill="{}"/><text x="{}" y="{}">{}</text>"#,
            W - RIGHT + 12.0,
            y - 10.0,
            COLORS[i % COLORS.len()],
            W - RIGHT + 30.0,
            y,
            escape(n)
        );
    }
}

/// A "nice" upper bound for an axis.
fn nice(max: f64) -> f64 {
    if max <= 0.0 || !max.is_finite() {
        return 1.0;
    }
    let mag = 10f64.powf(max.log10().floor());
    for m in [1.0, 2.0, 2.5, 5.0, 10.0] {
        if m * mag >= max {
            return m * mag;
        }
    }
    10.0 * mag
}

fn y_ticks(out: &mut String, top: f64, fmt: impl Fn(f64) -> String) {
    for i in 0..=4 {
        let v = top * i as f64 / 4.0;
        let y = H - BOTTOM - (H - BOTTOM - TOP) * i as f64 / 4.0;
        let _ = writeln!(
            out,
            r##"<line x1="{}" y1="{y}" x2="{}" y2="{y}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{}</text>"##,
            LEFT,
            W - RIGHT,
            LEFT - 6.0,
            y + 4.0,
            fmt(v)
        );
    }
}

/// Cumulative distributions: each series is its sorted samples (ms).
pub fn cdf(title: &str, x_label: &str, series: &[(&str, Vec<f64>)]) -> String {
    let mut out = String::new();
    frame(&mut out, title, x_label, "fraction of requests");
    let max = series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .fold(0.0f64, f64::max);
    let x_max = nice(max);
    y_ticks(&mut out, 1.0, |v| format!("{v:.2}"));
    for i in 0..=4 {
        let v = x_max * i as f64 / 4.0;
        let x = LEFT + (W - RIGHT - LEFT) * i as f64 / 4.0;
        let _ = writeln!(
            out,
            r#"<text x="{x}" y="{}" text-anchor="middle">{v:.0}</text>"#,
            H - BOTTOM + 16.0
        );
    }
    for (i, (_, v)) in series.iter().enumerate() {
        if v.is_empty() {
            continue;
        }
        let n = v.len() as f64;
        let pts: Vec<String> = v
            .iter()
            .enumerate()
            .map(|(k, x)| {
                let px = LEFT + (W - RIGHT - LEFT) * (x / x_max);
                let py = H - BOTTOM - (H - BOTTOM - TOP) * ((k + 1) as f64 / n);
                format!("{px:.1},{py:.1}")
            })
            .collect();
        let _ = writeln!(
            out,
            r#"<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>"#,
            COLORS[i % COLORS.len()],
            pts.join(" ")
        );
    }
    let names: Vec<&str> = series.iter().map(|(n, _)| *n).collect();
    legend(&mut out, &names);
    out.push_str("</svg>\n");
    out
}

/// Grouped bars: one group per category, one bar per series.
pub fn bars(
    title: &str,
    y_label: &str,
    categories: &[String],
    series: &[(&str, Vec<f64>)],
) -> String {
    let mut out = String::new();
    frame(&mut out, title, "", y_label);
    let max = series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .fold(0.0f64, f64::max);
    let y_max = nice(max);
    y_ticks(&mut out, y_max, |v| {
        if y_max <= 1.0 {
            format!("{v:.2}")
        } else {
            format!("{v:.0}")
        }
    });
    let groups = categories.len().max(1) as f64;
    let group_w = (W - RIGHT - LEFT) / groups;
    let bar_w = group_w * 0.8 / series.len().max(1) as f64;
    for (g, c) in categories.iter().enumerate() {
        let gx = LEFT + group_w * g as f64;
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
            gx + group_w / 2.0,
            H - BOTTOM + 16.0,
            escape(c)
        );
        for (i, (_, v)) in series.iter().enumerate() {
            let val = v.get(g).copied().unwrap_or(0.0).max(0.0);
            let h = (H - BOTTOM - TOP) * (val / y_max);
            let _ = writeln!(
                out,
                r#"<rect x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{}"/>"#,
                gx + group_w * 0.1 + bar_w * i as f64,
                H - BOTTOM - h,
                bar_w,
                h,
                COLORS[i % COLORS.len()]
            );
        }
    }
    let names: Vec<&str> = series.iter().map(|(n, _)| *n).collect();
    legend(&mut out, &names);
    out.push_str("</svg>\n");
    out
}

/// Time series: each series is its (x, y) points in x order; `marks` are
/// horizontal reference lines (a target, a limit), drawn dashed.
pub fn lines(
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(&str, Vec<(f64, f64)>)],
    marks: &[(&str, f64)],
) -> String {
    let mut out = String::new();
    frame(&mut out, title, x_label, y_label);
    let points = || series.iter().flat_map(|(_, v)| v.iter().copied());
    let x_max = nice(points().map(|p| p.0).fold(0.0f64, f64::max));
    let y_max = nice(
        points()
            .map(|p| p.1)
            .chain(marks.iter().map(|m| m.1))
            .fold(0.0f64, f64::max),
    );
    y_ticks(&mut out, y_max, |v| {
        if y_max <= 1.0 {
            format!("{v:.2}")
        } else {
            format!("{v:.0}")
        }
    });
    let px = |x: f64| LEFT + (W - RIGHT - LEFT) * (x / x_max);
    let py = |y: f64| H - BOTTOM - (H - BOTTOM - TOP) * (y / y_max);
    for i in 0..=4 {
        let v = x_max * i as f64 / 4.0;
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{v:.0}</text>"#,
            px(v),
            H - BOTTOM + 16.0
        );
    }
    for (name, y) in marks {
        let _ = writeln!(
            out,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#888" stroke-dasharray="6 4"/><text x="{}" y="{:.1}" text-anchor="end" fill="#555">{}</text>"##,
            W - RIGHT,
            W - RIGHT - 4.0,
            py(*y) - 4.0,
            escape(name),
            y = py(*y),
        );
    }
    for (i, (_, v)) in series.iter().enumerate() {
        if v.is_empty() {
            continue;
        }
        let pts: Vec<String> = v
            .iter()
            .map(|(x, y)| format!("{:.1},{:.1}", px(*x), py(*y)))
            .collect();
        let _ = writeln!(
            out,
            r#"<polyline fill="none" stroke="{}" stroke-width="1.5" points="{}"/>"#,
            COLORS[i % COLORS.len()],
            pts.join(" ")
        );
    }
    let names: Vec<&str> = series.iter().map(|(n, _)| *n).collect();
    legend(&mut out, &names);
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charts_are_well_formed_svg() {
        let c = cdf(
            "TTFT",
            "ms",
            &[("a<b", vec![1.0, 2.0, 30.0]), ("empty", vec![])],
        );
        assert!(c.starts_with("<svg") && c.trim_end().ends_with("</svg>"));
        assert!(c.contains("a&lt;b"));
        assert_eq!(c.matches("<polyline").count(), 1);
        let b = bars(
            "hits",
            "rate",
            &["w1".into(), "w2".into()],
            &[("x", vec![0.5, 0.25]), ("y", vec![0.75])],
        );
        assert_eq!(
            b.matches("<rect x=").count(),
            4 + 2,
            "4 bars, 2 legend keys"
        );
        let l = lines(
            "temperature",
            "s",
            "°C",
            &[("w1", vec![(0.0, 40.0), (10.0, 85.0)]), ("w2", vec![])],
            &[("target", 82.0)],
        );
        assert_eq!(l.matches("<polyline").count(), 1);
        assert!(l.contains("stroke-dasharray") && l.contains(">target<"));
        assert_eq!(nice(7.0), 10.0);
        assert_eq!(nice(0.3), 0.5);
    }
}
