//! The charts drawn from a whole report:
//! - the bucket store (`target/bench/store.svg`, a copy in `docs/bench/store.svg` for
//!   BENCHMARKS.md): ns per packet over its driver floor against tracked sources, for a random
//!   known source and a new source (its first packet, and its second, which makes the bucket),
//!   this run's store beside the LRU contender (`crate::lru`: GCRA in a kernel `LRU_HASH` of
//!   2^20), measured in the same run at the same populations, in turns with the store, over the
//!   same driver floors, and this run's F1 (`crate::f1`) across them;
//! - the Redis backend's scale (`target/bench/redis_scale.svg`, [`redis_scale`]): admitted /
//!   budget and bytes per host against hosts, beside gossip's bytes per host at 2-16 real agents
//!   (this run's `cluster` part if it ran, else [`GOSSIP_PUBLISHED`]).

use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::prelude::*;

use crate::{redis::Scale, report::Report};

/// Tags of the populations, smallest first.
const TAGS: [&str; 4] = ["1k", "100k", "1m", "full"];

/// One line of the chart: (tracked sources, ns over the floor) per population.
type Series = Vec<(f64, f64)>;

/// This run's series of figure `what` (`known`, `new`, `new_made`) of the store (`lru` `None`)
/// or of the LRU contender `lru` (`kernel.lru.*`): ns over the figure's driver floor, at each
/// population the run measured it.
fn series(report: &Report, lru: Option<&str>, what: &str) -> Series {
    let floor_of = if what == "known" {
        "known_floor"
    } else {
        "new_floor"
    };
    let mut points = Vec::new();
    for tag in TAGS {
        let key = |w: &str| match lru {
            Some(lru) if !w.ends_with("floor") => format!("kernel.{lru}.{w}_{tag}"),
            _ => format!("kernel.pop.{tag}.{w}"),
        };
        let Some(tracked) = report
            .get(&key("known"))
            .and_then(|f| f.detail["tracked_buckets"].as_u64())
        else {
            continue;
        };
        #[expect(clippy::cast_precision_loss, reason = "a chart's x")]
        let x = tracked as f64;
        if let (Some(v), Some(floor)) = (report.value(&key(what)), report.value(&key(floor_of))) {
            points.push((x, v - floor));
        }
    }
    points
}

/// Writes the chart to `path` (SVG).
pub fn store(report: &Report, path: &Path) -> Result<()> {
    let known = series(report, None, "known");
    let new = series(report, None, "new");
    let made = series(report, None, "new_made");
    let lru_known = series(report, Some("lru"), "known");
    let lru_new = series(report, Some("lru"), "new");
    let date = report.machine["date"].as_str().unwrap_or("?");
    let git = report.machine["git"].as_str().unwrap_or("?");
    let blue = RGBColor(31, 90, 180);
    let red = RGBColor(200, 50, 40);
    let orange = RGBColor(230, 140, 20);
    let lines: [Line<'_>; 5] = [
        (
            &known,
            blue,
            false,
            format!("random known source, the limiter's store (git {git})"),
        ),
        (
            &new,
            red,
            false,
            "new source, its first packet (passes without a bucket), the limiter's store".into(),
        ),
        (
            &made,
            orange,
            false,
            "new source, its second packet (makes its bucket), the limiter's store".into(),
        ),
        (
            &lru_known,
            blue,
            true,
            "random known source, LRU contender (LRU_HASH, this run)".into(),
        ),
        (
            &lru_new,
            red,
            true,
            "new source, LRU contender (inserts, evicting when full)".into(),
        ),
    ];
    // F1 (one dependent read of a region the store's size), the unit of #36's targets.
    let f1 = report.value("kernel.f1");
    let footer = format!("this run, {date}, git {git}: both over the limiter's driver floors");
    draw_store(path, &lines, f1, &footer).map_err(|e| anyhow!("drawing {}: {e}", path.display()))
}

/// A line of the store's chart: its points, colour, whether dashed (the LRU contender's), label.
type Line<'a> = (&'a Series, RGBColor, bool, String);

/// Draws the store's chart: `lines` over tracked sources, F1 across them if measured.
fn draw_store(
    path: &Path,
    lines: &[Line<'_>],
    f1: Option<f64>,
    footer: &str,
) -> std::result::Result<(), Box<dyn std::error::Error>> {
    let top = lines
        .iter()
        .flat_map(|(points, ..)| points.iter().map(|&(_, y)| y))
        .chain(f1)
        .fold(100.0, f64::max)
        * 1.15;
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Bucket store: in-kernel ns per packet over its floor vs tracked sources",
            ("sans-serif", 20),
        )
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d((500f64..2.0e6f64).log_scale(), 0f64..top)?;
    chart
        .configure_mesh()
        .x_desc("tracked sources (buckets in the store)")
        .y_desc("ns per packet minus the driver floor")
        .x_label_formatter(&|x| tracked_label(*x))
        .draw()?;
    if let Some(f1) = f1 {
        let style = RGBColor(120, 120, 120).stroke_width(1);
        chart
            .draw_series(DashedLineSeries::new(
                [(500.0, f1), (2.0e6, f1)],
                3,
                4,
                style,
            ))?
            .label(format!(
                "F1: one dependent memory read, {f1:.0} ns (this run)"
            ))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
    }
    for (points, color, dashed, label) in lines {
        let (color, dashed) = (*color, *dashed);
        let style = color.stroke_width(if dashed { 2 } else { 3 });
        if dashed {
            chart
                .draw_series(DashedLineSeries::new(points.iter().copied(), 8, 6, style))?
                .label(label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 8, y)], style));
        } else {
            chart
                .draw_series(LineSeries::new(points.iter().copied(), style))?
                .label(label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        }
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
    }
    upper_left_legend(&mut chart)?;
    root.draw(&Text::new(footer, (16, 540), ("sans-serif", 12)))?;
    root.present()?;
    Ok(())
}

/// A tracked-source count as the x axis shows it: 1k, 100k, 1M.
fn tracked_label(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.0}M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.0}k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

/// Gossip sent per host (B/s) at 2, 4, 8 and 16 real agents as BENCHMARKS.md's cluster table
/// gives it (`--only cluster`, 2026-11-28, 292812f): drawn when this run did not measure them.
pub const GOSSIP_PUBLISHED: [(usize, f64); 4] =
    [(2, 10_300.0), (4, 32_000.0), (8, 43_700.0), (16, 60_400.0)];

/// Writes the Redis backend's chart to `path` (SVG): `runs` (see [`crate::redis`]) and gossip's
/// bytes per host from `report` (or [`GOSSIP_PUBLISHED`]).
pub fn redis_scale(report: &Report, runs: &[Scale], path: &Path) -> Result<()> {
    let (gossip, gossip_from) = gossip_sent(report);
    let per_run =
        |f: fn(&Scale) -> f64| -> Series { runs.iter().map(|r| (hosts(r.hosts), f(r))).collect() };
    let admitted = per_run(|r| r.admitted);
    let sent = per_run(|r| r.bytes_in_per_host.max(1.0));
    let got = per_run(|r| r.bytes_out_per_host.max(1.0));
    let date = report.machine["date"].as_str().unwrap_or("?");
    let git = report.machine["git"].as_str().unwrap_or("?");
    let draw = || -> Drawn {
        let root = SVGBackend::new(path, (900, 820)).into_drawing_area();
        root.fill(&WHITE)?;
        let (upper, lower) = root.split_vertically(390);
        admitted_panel(&upper, &admitted)?;
        bytes_panel(
            &lower,
            [
                (
                    &sent,
                    BLUE_LINE,
                    "Redis: sent to the store per host (simulated hosts, this run)",
                ),
                (&got, GREEN_LINE, "Redis: received from the store per host"),
                (&gossip, RED_LINE, gossip_from),
            ],
        )?;
        root.draw(&Text::new(
            format!("{date}, git {git}: a local 3-master Redis Cluster on the same machine"),
            (16, 800),
            ("sans-serif", 12),
        ))?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| anyhow!("drawing {}: {e}", path.display()))
}

/// A drawing step's result (plotters' errors are each backend's own type).
type Drawn = std::result::Result<(), Box<dyn std::error::Error>>;

/// A panel of a chart drawn in SVG.
type Panel<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

const BLUE_LINE: RGBColor = RGBColor(31, 90, 180);
const RED_LINE: RGBColor = RGBColor(200, 50, 40);
const GREEN_LINE: RGBColor = RGBColor(40, 140, 60);

/// Host counts as a chart's x.
#[expect(clippy::cast_precision_loss, reason = "host counts")]
fn hosts(n: usize) -> f64 {
    n as f64
}

/// Gossip's bytes sent per host at 2-16 agents: this run's (`cluster.n{N}.gossip`) if it has
/// them, else [`GOSSIP_PUBLISHED`]; and the line's label, which says which.
fn gossip_sent(report: &Report) -> (Series, &'static str) {
    let measured: Series = [2, 4, 8, 16]
        .iter()
        .filter_map(|&n| Some((hosts(n), report.value(&format!("cluster.n{n}.gossip"))?)))
        .collect();
    if measured.is_empty() {
        (
            GOSSIP_PUBLISHED
                .iter()
                .map(|&(n, b)| (hosts(n), b))
                .collect(),
            "gossip sent per host, real agents (BENCHMARKS.md, 2026-11-28, 292812f)",
        )
    } else {
        (measured, "gossip sent per host, real agents (this run)")
    }
}

/// The Redis chart's upper panel: admitted / budget against hosts, over the budget's line at 1.
fn admitted_panel(area: &Panel<'_>, admitted: &Series) -> Drawn {
    let top = admitted.iter().map(|p| p.1).fold(2.0, f64::max) * 1.1;
    let mut chart = ChartBuilder::on(area)
        .caption(
            "Redis backend: admitted / budget (10 keys shared by all hosts, 95/5, sync 100 ms)",
            ("sans-serif", 18),
        )
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d((1.5f64..3000f64).log_scale(), 0f64..top)?;
    chart
        .configure_mesh()
        .x_desc("hosts")
        .y_desc("admitted / budget")
        .draw()?;
    chart.draw_series(LineSeries::new(
        vec![(1.5, 1.0), (3000.0, 1.0)],
        RGBColor(150, 150, 150).stroke_width(1),
    ))?;
    chart.draw_series(LineSeries::new(
        admitted.iter().copied(),
        BLUE_LINE.stroke_width(3),
    ))?;
    chart.draw_series(
        admitted
            .iter()
            .map(|&p| Circle::new(p, 4, BLUE_LINE.filled())),
    )?;
    Ok(())
}

/// The Redis chart's lower panel: bytes per host and second against hosts, each of `lines`
/// (points, colour, label) with its legend.
fn bytes_panel(area: &Panel<'_>, lines: [(&Series, RGBColor, &str); 3]) -> Drawn {
    let top = lines
        .iter()
        .flat_map(|(points, ..)| points.iter())
        .map(|p| p.1)
        .fold(1e5, f64::max)
        * 2.0;
    let mut chart = ChartBuilder::on(area)
        .caption(
            "Bytes per host and second against hosts",
            ("sans-serif", 18),
        )
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d((1.5f64..3000f64).log_scale(), (100f64..top).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("hosts")
        .y_desc("bytes/s per host")
        .draw()?;
    for (points, color, label) in lines {
        let style = color.stroke_width(3);
        chart
            .draw_series(LineSeries::new(points.iter().copied(), style))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
    }
    upper_left_legend(&mut chart)
}

/// The legend of `chart`'s labelled series, in its upper left corner.
fn upper_left_legend<'a, CT: plotters::coord::CoordTranslate>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, CT>,
) -> Drawn {
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::report::Figure;

    /// One host count's figures, `k` scaling them apart.
    fn scale(hosts: usize, k: f64) -> Scale {
        Scale {
            hosts,
            secs: 5.0,
            cmds_per_host: 10.0 * k,
            bytes_in_per_host: 2_000.0 * k,
            bytes_out_per_host: 1_000.0 * k,
            redis_cpu: 0.1,
            client_cpu: 0.1,
            rtt_p50_ms: 1.0,
            rtt_p99_ms: 2.0,
            rounds_per_host: 10.0,
            errors_per_host: 0.0,
            admitted: 0.9 + 0.01 * k,
            admitted_ok: 1.0,
            holders_seen_max: 8,
            holders_seen_mean: 8.0,
            loadavg: "0.5".into(),
        }
    }

    /// A figure of `runs` (one run each here), its detail `detail`.
    fn figure(key: &str, ns: f64, detail: serde_json::Value) -> Figure {
        Figure {
            key: key.into(),
            section: "kernel",
            label: key.into(),
            unit: "ns",
            runs: vec![ns],
            baseline: None,
            detail,
        }
    }

    /// The store chart draws a point for each population the run measured on each of its five
    /// lines (the store's known, first and second packet; the LRU contender's known and new),
    /// over each figure's own driver floor, and F1 across them when the run measured it.
    #[test]
    fn the_store_chart_draws_each_population_beside_the_lru_contender_and_f1() {
        let dir = std::env::temp_dir().join(format!("rl-store-chart-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut report = Report {
            machine: json!({"date": "2026-12-03", "git": "def5678"}),
            ..Report::default()
        };
        for (tag, tracked) in [("1k", 1_000), ("1m", 1_000_000), ("full", 1_048_576)] {
            let detail = json!({ "tracked_buckets": tracked });
            for (key, ns) in [
                (format!("kernel.pop.{tag}.known_floor"), 30.0),
                (format!("kernel.pop.{tag}.new_floor"), 40.0),
                (format!("kernel.pop.{tag}.known"), 330.0),
                (format!("kernel.pop.{tag}.new"), 250.0),
                (format!("kernel.pop.{tag}.new_made"), 560.0),
                (format!("kernel.lru.known_{tag}"), 500.0),
                (format!("kernel.lru.new_{tag}"), 900.0),
            ] {
                report.add(figure(&key, ns, detail.clone()));
            }
        }
        // Each over its own driver's floor: known over the known floor, both new over the new.
        let at = |v: f64| vec![(1e3, v), (1e6, v), (1_048_576.0, v)];
        assert_eq!(series(&report, None, "known"), at(300.0));
        assert_eq!(series(&report, None, "new"), at(210.0));
        assert_eq!(series(&report, None, "new_made"), at(520.0));
        assert_eq!(series(&report, Some("lru"), "known"), at(470.0));
        assert_eq!(series(&report, Some("lru"), "new"), at(860.0));
        assert_eq!(series(&report, Some("lru"), "new_made"), vec![]);
        let svg = dir.join("store.svg");
        store(&report, &svg).unwrap();
        let without_f1 = std::fs::read_to_string(&svg).unwrap();
        report.add(figure("kernel.f1", 136.0, json!({})));
        store(&report, &svg).unwrap();
        let with_f1 = std::fs::read_to_string(&svg).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        for text in [
            "random known source, the limiter",
            "(git def5678)",
            "its second packet (makes its bucket)",
            "random known source, LRU contender",
            "2026-12-03, git def5678",
        ] {
            assert!(without_f1.contains(text), "{text} missing");
        }
        // 5 lines x 3 populations, with the legend's marks none (they are paths).
        assert_eq!(without_f1.matches("<circle").count(), 15, "{without_f1}");
        assert_eq!(with_f1.matches("<circle").count(), 15);
        assert!(!without_f1.contains("F1: one dependent memory read"));
        assert!(with_f1.contains("F1: one dependent memory read, 136 ns (this run)"));
    }

    /// The Redis chart draws both panels: every host count's point on each of its lines, the
    /// gossip line measured in this run when the report has it (else the published one), and the
    /// captions.
    #[test]
    fn the_redis_chart_draws_each_runs_points_and_this_runs_gossip() {
        let dir = std::env::temp_dir().join(format!("rl-chart-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let runs = [scale(2, 1.0), scale(64, 2.0), scale(2048, 3.0)];
        let mut report = Report {
            machine: json!({"date": "2026-12-01", "git": "abc1234"}),
            ..Report::default()
        };
        let svg = dir.join("published.svg");
        redis_scale(&report, &runs, &svg).unwrap();
        let published = std::fs::read_to_string(&svg).unwrap();
        report.add(Figure {
            key: "cluster.n2.gossip".into(),
            section: "cluster",
            label: "gossip".into(),
            unit: "B/s",
            runs: vec![12_345.0],
            baseline: None,
            detail: json!({}),
        });
        redis_scale(&report, &runs, &svg).unwrap();
        let measured = std::fs::read_to_string(&svg).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        for text in [
            "Redis backend: admitted / budget",
            "Bytes per host and second against hosts",
            "Redis: sent to the store per host",
            "2026-12-01, git abc1234",
        ] {
            assert!(published.contains(text), "{text} missing");
        }
        assert!(published.contains("(BENCHMARKS.md, 2026-11-28, 292812f)"));
        assert!(measured.contains("real agents (this run)"));
        // Points: 3 admitted + 3 sent + 3 received + the gossip line's (4 published, 1 measured).
        assert_eq!(published.matches("<circle").count(), 13, "{published}");
        assert_eq!(measured.matches("<circle").count(), 10, "{measured}");
    }
}
