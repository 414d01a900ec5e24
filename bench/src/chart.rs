//! The chart of the bucket store (`target/bench/store.svg`): ns per packet over its driver floor
//! against tracked sources, for a random known source and a new source, this run's store beside
//! the LRU contender (`crate::lru`: GCRA in a kernel `LRU_HASH` of 2^20), measured in the same
//! run at the same populations, in turns with the store, over the same driver floors.

use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::prelude::*;

use crate::report::Report;

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
