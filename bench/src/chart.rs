//! The charts drawn from a whole report:
//! - the bucket store (`target/bench/store.svg`): ns per packet over its driver floor against
//!   tracked sources, for a random known source and a new source, this run's store beside the
//!   LRU contender (`crate::lru`: GCRA in a kernel `LRU_HASH` of 2^20), measured in the same run
//!   at the same populations, in turns with the store, over the same driver floors;
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

/// This run's series of the store (`None`) or of the LRU contender `lru` (`kernel.lru.*`):
/// (random known, new source).
fn series(report: &Report, lru: Option<&str>) -> (Series, Series) {
    let (mut known, mut new) = (Vec::new(), Vec::new());
    for tag in TAGS {
        let floor = |what: &str| format!("kernel.pop.{tag}.{what}");
        let k = |what: &str| match lru {
            Some(lru) if !what.ends_with("floor") => format!("kernel.{lru}.{what}_{tag}"),
            _ => floor(what),
        };
        let Some(tracked) = report
            .get(&k("known"))
            .and_then(|f| f.detail["tracked_buckets"].as_u64())
        else {
            continue;
        };
        #[expect(clippy::cast_precision_loss, reason = "a chart's x")]
        let x = tracked as f64;
        let over = |a: &str, b: &str| Some(report.value(&k(a))? - report.value(&k(b))?);
        if let Some(y) = over("known", "known_floor") {
            known.push((x, y));
        }
        if let Some(y) = over("new", "new_floor") {
            new.push((x, y));
        }
    }
    (known, new)
}

/// Writes the chart to `path` (SVG).
pub fn store(report: &Report, path: &Path) -> Result<()> {
    let (known, new) = series(report, None);
    let (lru_known, lru_new) = series(report, Some("lru"));
    let top = known
        .iter()
        .chain(&new)
        .chain(&lru_known)
        .chain(&lru_new)
        .map(|&(_, y)| y)
        .fold(100.0, f64::max)
        * 1.15;
    let date = report.machine["date"].as_str().unwrap_or("?");
    let git = report.machine["git"].as_str().unwrap_or("?");
    let draw = || -> std::result::Result<(), Box<dyn std::error::Error>> {
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
            .x_label_formatter(&|x| {
                if *x >= 1e6 {
                    format!("{:.0}M", x / 1e6)
                } else if *x >= 1e3 {
                    format!("{:.0}k", x / 1e3)
                } else {
                    format!("{x:.0}")
                }
            })
            .draw()?;
        let blue = RGBColor(31, 90, 180);
        let red = RGBColor(200, 50, 40);
        let lines: [(&Series, RGBColor, bool, String); 4] = [
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
                "new source (creates its bucket), the limiter's store".into(),
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
        for (points, color, dashed, label) in lines {
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
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
        root.draw(&Text::new(
            format!("this run, {date}, git {git}: both over the limiter's driver floors"),
            (16, 540),
            ("sans-serif", 12),
        ))?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| anyhow!("drawing {}: {e}", path.display()))
}

/// Gossip sent per host (B/s) at 2, 4, 8 and 16 real agents as BENCHMARKS.md's cluster table
/// gives it (`--only cluster`, 2026-11-28, 292812f): drawn when this run did not measure them.
pub const GOSSIP_PUBLISHED: [(usize, f64); 4] =
    [(2, 10_300.0), (4, 32_000.0), (8, 43_700.0), (16, 60_400.0)];

/// Writes the Redis backend's chart to `path` (SVG): `runs` (see [`crate::redis`]) and gossip's
/// bytes per host from `report` (or [`GOSSIP_PUBLISHED`]).
pub fn redis_scale(report: &Report, runs: &[Scale], path: &Path) -> Result<()> {
    #[expect(clippy::cast_precision_loss, reason = "host counts")]
    let x = |n: usize| n as f64;
    let measured: Vec<(f64, f64)> = [2, 4, 8, 16]
        .iter()
        .filter_map(|&n| Some((x(n), report.value(&format!("cluster.n{n}.gossip"))?)))
        .collect();
    let (gossip, gossip_from) = if measured.is_empty() {
        (
            GOSSIP_PUBLISHED.iter().map(|&(n, b)| (x(n), b)).collect(),
            "gossip sent per host, real agents (BENCHMARKS.md, 2026-11-28, 292812f)",
        )
    } else {
        (measured, "gossip sent per host, real agents (this run)")
    };
    let admitted: Vec<(f64, f64)> = runs.iter().map(|r| (x(r.hosts), r.admitted)).collect();
    let sent: Vec<(f64, f64)> = runs
        .iter()
        .map(|r| (x(r.hosts), r.bytes_in_per_host.max(1.0)))
        .collect();
    let got: Vec<(f64, f64)> = runs
        .iter()
        .map(|r| (x(r.hosts), r.bytes_out_per_host.max(1.0)))
        .collect();
    let top = admitted.iter().map(|p| p.1).fold(2.0, f64::max) * 1.1;
    let bytes_top = sent
        .iter()
        .chain(&got)
        .chain(&gossip)
        .map(|p| p.1)
        .fold(1e5, f64::max)
        * 2.0;
    let date = report.machine["date"].as_str().unwrap_or("?");
    let git = report.machine["git"].as_str().unwrap_or("?");
    let draw = || -> std::result::Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::new(path, (900, 820)).into_drawing_area();
        root.fill(&WHITE)?;
        let (upper, lower) = root.split_vertically(390);
        let blue = RGBColor(31, 90, 180);
        let red = RGBColor(200, 50, 40);
        let green = RGBColor(40, 140, 60);
        let grey = RGBColor(150, 150, 150);
        let mut chart = ChartBuilder::on(&upper)
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
            grey.stroke_width(1),
        ))?;
        chart.draw_series(LineSeries::new(
            admitted.iter().copied(),
            blue.stroke_width(3),
        ))?;
        chart.draw_series(admitted.iter().map(|&p| Circle::new(p, 4, blue.filled())))?;
        let mut chart = ChartBuilder::on(&lower)
            .caption(
                "Bytes per host and second against hosts",
                ("sans-serif", 18),
            )
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(
                (1.5f64..3000f64).log_scale(),
                (100f64..bytes_top).log_scale(),
            )?;
        chart
            .configure_mesh()
            .x_desc("hosts")
            .y_desc("bytes/s per host")
            .draw()?;
        for (points, color, label) in [
            (
                &sent,
                blue,
                "Redis: sent to the store per host (simulated hosts, this run)",
            ),
            (&got, green, "Redis: received from the store per host"),
            (&gossip, red, gossip_from),
        ] {
            let style = color.stroke_width(3);
            chart
                .draw_series(LineSeries::new(points.iter().copied(), style))?
                .label(label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
            chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
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
