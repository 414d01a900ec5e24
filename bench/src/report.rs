//! What a benchmark run found: figures (each the median of several runs, with every run kept),
//! ratios against a baseline figure of the same run, and the targets judged from them. Printed as
//! a table and written as JSON.

use std::{fmt::Write as _, path::Path};

use anyhow::{Context as _, Result};
use serde_json::{json, Value};

/// One measured figure.
#[derive(Clone, Debug)]
pub struct Figure {
    /// Stable identifier (`kernel.floor`, `e2e.hot.limiter`), the JSON key.
    pub key: String,
    /// Table section.
    pub section: &'static str,
    /// What was measured, for the table.
    pub label: String,
    /// Unit of the value (`ns/pkt`, `Mpps`, `ms`, `bytes`, `%`).
    pub unit: &'static str,
    /// Every run's value.
    pub runs: Vec<f64>,
    /// Key of the figure this one is compared with (same run), if any.
    pub baseline: Option<String>,
    /// Extra facts (counters, what passed and dropped), for the JSON only.
    pub detail: Value,
}

impl Figure {
    /// The median of the runs (NaN when there are none).
    pub fn median(&self) -> f64 {
        median(&self.runs)
    }
}

/// The median of `values` (the mean of the middle two for an even count; NaN if empty).
pub fn median(values: &[f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// A target of the issue, judged from figures of this run.
#[derive(Clone, Debug)]
pub struct Target {
    /// What is asked, in words.
    pub goal: String,
    /// Whether the figures meet it (`None`: could not be judged, a figure is missing).
    pub met: Option<bool>,
    /// The numbers behind the verdict.
    pub evidence: String,
}

/// Everything one run measured.
#[derive(Debug, Default)]
pub struct Report {
    /// Figures in the order they were measured.
    pub figures: Vec<Figure>,
    /// Targets, judged at the end.
    pub targets: Vec<Target>,
    /// Facts about the machine and the run.
    pub machine: Value,
    /// Free-form notes printed under the table (how a figure was measured, caveats).
    pub notes: Vec<String>,
}

impl Report {
    /// Adds a figure and returns its key.
    pub fn add(&mut self, figure: Figure) -> String {
        let key = figure.key.clone();
        self.figures.retain(|f| f.key != key);
        self.figures.push(figure);
        key
    }

    /// The figure with `key`.
    pub fn get(&self, key: &str) -> Option<&Figure> {
        self.figures.iter().find(|f| f.key == key)
    }

    /// Median of figure `key`, if it was measured.
    pub fn value(&self, key: &str) -> Option<f64> {
        self.get(key).map(Figure::median).filter(|v| v.is_finite())
    }

    /// `figure / baseline` (medians), if both were measured.
    pub fn ratio(&self, figure: &Figure) -> Option<f64> {
        let base = self.value(figure.baseline.as_deref()?)?;
        let v = figure.median();
        (base != 0.0 && v.is_finite()).then(|| v / base)
    }

    /// The table, as printed at the end of a run.
    pub fn table(&self) -> String {
        let text = self.table_lines();
        let mut out = String::with_capacity(text.len());
        for line in text.lines() {
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }

    fn table_lines(&self) -> String {
        let mut out = String::new();
        let m = &self.machine;
        let _ = writeln!(
            out,
            "ratelimit benchmark: {} | kernel {} | {} CPUs ({}) | load average {} before, {} after",
            m["date"].as_str().unwrap_or("?"),
            m["kernel"].as_str().unwrap_or("?"),
            m["cpus"],
            m["cpu_model"].as_str().unwrap_or("?"),
            m["loadavg_before"].as_str().unwrap_or("?"),
            m["loadavg_after"].as_str().unwrap_or("?"),
        );
        let _ = writeln!(
            out,
            "Each figure is the median of its runs (spread: lowest..highest run); ratios are against the \
             baseline named, measured in this same run."
        );
        let mut section = "";
        for f in &self.figures {
            if f.section != section {
                section = f.section;
                let _ = writeln!(out, "\n{section}");
                let _ = writeln!(
                    out,
                    "  {:<62} {:>10} {:<7} {:>19} {:>6}  vs baseline",
                    "", "median", "unit", "spread", "runs"
                );
            }
            let lo = f.runs.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = f.runs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let spread = if f.runs.len() > 1 {
                format!("{}..{}", num(lo), num(hi))
            } else {
                String::new()
            };
            let vs = match (self.ratio(f), f.baseline.as_deref()) {
                (Some(r), Some(b)) => format!("{r:.2}x {b}"),
                _ => String::new(),
            };
            let _ = writeln!(
                out,
                "  {:<62} {:>10} {:<7} {:>19} {:>6}  {}",
                truncate(&f.label, 62),
                num(f.median()),
                f.unit,
                spread,
                f.runs.len(),
                vs
            );
        }
        if !self.targets.is_empty() {
            let _ = writeln!(out, "\nTargets (ratios from this run)");
            for t in &self.targets {
                let mark = match t.met {
                    Some(true) => "MET   ",
                    Some(false) => "MISSED",
                    None => "n/a   ",
                };
                let _ = writeln!(out, "  [{mark}] {}\n           {}", t.goal, t.evidence);
            }
        }
        if !self.notes.is_empty() {
            let _ = writeln!(out, "\nNotes");
            for n in &self.notes {
                let _ = writeln!(out, "  - {n}");
            }
        }
        out
    }

    /// The JSON document written to `results.json`.
    pub fn json(&self) -> Value {
        let figures: Vec<Value> = self
            .figures
            .iter()
            .map(|f| {
                json!({
                    "key": f.key,
                    "section": f.section,
                    "label": f.label,
                    "unit": f.unit,
                    "median": finite(f.median()),
                    "runs": f.runs,
                    "baseline": f.baseline,
                    "ratio_to_baseline": self.ratio(f),
                    "detail": f.detail,
                })
            })
            .collect();
        let targets: Vec<Value> = self
            .targets
            .iter()
            .map(|t| json!({ "goal": t.goal, "met": t.met, "evidence": t.evidence }))
            .collect();
        json!({
            "machine": self.machine,
            "figures": figures,
            "targets": targets,
            "notes": self.notes,
        })
    }

    /// Writes [`Report::json`] to `path`, creating its directory.
    pub fn write_json(&self, path: &Path) -> Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let text = serde_json::to_string_pretty(&self.json())?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))
    }
}

fn finite(v: f64) -> Value {
    if v.is_finite() {
        json!(v)
    } else {
        Value::Null
    }
}

/// A number with as many digits as it deserves.
fn num(v: f64) -> String {
    if !v.is_finite() {
        return "-".into();
    }
    let a = v.abs();
    if a >= 1000.0 {
        format!("{v:.0}")
    } else if a >= 100.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(n - 1).collect();
        t.push('~');
        t
    }
}
