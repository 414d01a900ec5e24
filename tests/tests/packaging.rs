//! The Debian package (`cargo xtask package`) and what ships in it: contents and conffiles
//! (`dpkg-deb`), the systemd unit (`systemd-analyze verify`), every man page rendered (`man -l`,
//! no warnings), the shell completions parsed (`bash -n`, `zsh -n`, `fish -n`), and the Grafana
//! dashboard and Prometheus alert rules (`promtool check rules`, and every metric they name is
//! one the agent exports). `cargo xtask setup` installs the tools.
//!
//! The package is built once per run of this file, from the debug build the other tests run
//! (`cargo xtask package --debug`: the release build would add minutes, and what is checked here
//! does not depend on it); `RATELIMIT_DEB=path.deb` checks an already built one instead (e.g. the
//! release package: `RATELIMIT_DEB=$(cargo xtask package | tail -1)`).

use std::fs;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The built package, unpacked: `root` holds its files (`dpkg-deb -x`), `control` its control
/// files (`dpkg-deb -e`).
struct Unpacked {
    deb: PathBuf,
    root: PathBuf,
    control: PathBuf,
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e} (is it installed? `cargo xtask setup`)"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn stdout(cmd: &mut Command) -> String {
    String::from_utf8(run(cmd).stdout).unwrap()
}

/// The directory the package is built and unpacked in, shared by this binary's tests.
fn package_dir() -> PathBuf {
    std::env::temp_dir().join(format!("rl-pkg-test-{}", std::process::id()))
}

/// Removes [`package_dir`] when the test binary exits (after every test that shares it): the
/// harness has no teardown, and the directory (a debug build's .deb, unpacked) was left behind
/// by every run.
extern "C" fn remove_package_dir() {
    let _ = fs::remove_dir_all(package_dir());
}

fn package() -> &'static Unpacked {
    static PACKAGE: OnceLock<Unpacked> = OnceLock::new();
    PACKAGE.get_or_init(|| {
        let dir = package_dir();
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        // SAFETY: registers a plain function with no arguments, run once at exit.
        unsafe { libc::atexit(remove_package_dir) };
        let deb = if let Some(deb) = std::env::var_os("RATELIMIT_DEB") {
            PathBuf::from(deb)
        } else {
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let out = stdout(
                Command::new(cargo)
                    .current_dir(workspace())
                    // The debug build the other tests run: the same contents, without a
                    // release build (about 6 minutes of CI on 2 cores).
                    .args(["xtask", "package", "--debug", "--out"])
                    .arg(dir.join("out")),
            );
            PathBuf::from(
                out.lines()
                    .last()
                    .expect("cargo xtask package prints the .deb")
                    .trim(),
            )
        };
        let (root, control) = (dir.join("root"), dir.join("control"));
        run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root));
        run(Command::new("dpkg-deb").arg("-e").arg(&deb).arg(&control));
        Unpacked { deb, root, control }
    })
}

/// The conffile's commented examples are valid as written: every `# key = ...` and `# [[...]]`
/// line uncommented (the `[agent]` settings, every rule, the `[[rule.limit]]`) passes
/// `ratelimit check`, and holds the rules and the limit they show. Needs no package: it reads
/// the source file.
#[test]
fn the_conffile_examples_uncommented_pass_check() {
    let source = fs::read_to_string(workspace().join("packaging/debian/ratelimit.toml")).unwrap();
    let uncommented: String = source
        .lines()
        .map(|line| {
            let rest = line.strip_prefix("# ").unwrap_or(line);
            let setting = rest.starts_with("[[")
                || rest.split_once(" = ").is_some_and(|(k, _)| {
                    !k.is_empty() && k.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
                });
            if setting {
                rest
            } else {
                line
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    let dir = std::env::temp_dir().join(format!("rl-conffile-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    let file = dir.join("ratelimit.toml");
    fs::write(&file, &uncommented).unwrap();
    let checked = Command::new(ratelimit_testbed::agent_binary())
        .arg("check")
        .arg("-c")
        .arg(&file)
        .output()
        .unwrap();
    let _ = fs::remove_dir_all(&dir);
    assert!(
        checked.status.success(),
        "{}\n{uncommented}",
        String::from_utf8_lossy(&checked.stderr)
    );
    let parsed: toml::Table = uncommented.parse().unwrap();
    let rules = parsed["rule"].as_array().unwrap();
    let names: Vec<&str> = rules.iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["ipv4-per-source", "ipv6-per-64", "https", "office"]);
    let https = rules
        .iter()
        .find(|r| r["name"].as_str() == Some("https"))
        .unwrap();
    assert_eq!(https["limit"].as_array().map(Vec::len), Some(1), "{https}");
}

#[test]
fn package_holds_binary_conffile_unit_pages_completions_and_scripts() {
    let pkg = package();
    assert_eq!(
        stdout(
            Command::new("dpkg-deb")
                .arg("-f")
                .arg(&pkg.deb)
                .arg("Package")
        )
        .trim(),
        "ratelimit"
    );
    let listing = stdout(Command::new("dpkg-deb").arg("-c").arg(&pkg.deb));
    for path in [
        "./usr/sbin/ratelimit",
        "./etc/ratelimit/ratelimit.toml",
        "./etc/default/ratelimit",
        "./lib/systemd/system/ratelimit.service",
        "./usr/share/man/man8/ratelimit.8.gz",
        "./usr/share/man/man8/ratelimit-agent.8.gz",
        "./usr/share/man/man5/ratelimit.toml.5.gz",
        "./usr/share/bash-completion/completions/ratelimit",
        "./usr/share/zsh/vendor-completions/_ratelimit",
        "./usr/share/fish/vendor_completions.d/ratelimit.fish",
        "./usr/share/doc/ratelimit/grafana/ratelimit-dashboard.json",
        "./usr/share/doc/ratelimit/prometheus/ratelimit-alerts.yml",
        "./usr/share/doc/ratelimit/examples/ratelimit.toml",
    ] {
        assert!(
            listing
                .lines()
                .any(|l| l.split_whitespace().last() == Some(path)),
            "{path} not in the package:\n{listing}"
        );
    }
    let binary = pkg.root.join("usr/sbin/ratelimit");
    let mode = fs::metadata(&binary).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o755, "{}", binary.display());
    assert!(stdout(Command::new(&binary).arg("--version")).starts_with("ratelimit "));

    // Both files under /etc are conffiles: an upgrade keeps the operator's edits.
    let conffiles = fs::read_to_string(pkg.control.join("conffiles")).unwrap();
    let mut conffiles: Vec<&str> = conffiles.lines().map(str::trim).collect();
    conffiles.sort_unstable();
    assert_eq!(
        conffiles,
        ["/etc/default/ratelimit", "/etc/ratelimit/ratelimit.toml"]
    );

    // The conffile is valid, and attaches to nothing and limits nothing until edited.
    let conffile = pkg.root.join("etc/ratelimit/ratelimit.toml");
    run(Command::new(&binary).arg("check").arg("-c").arg(&conffile));
    let parsed: toml::Table = fs::read_to_string(&conffile).unwrap().parse().unwrap();
    assert_eq!(
        parsed["agent"]["interfaces"].as_array().map(Vec::len),
        Some(0),
        "{parsed}"
    );
    assert!(
        parsed.get("rule").is_none(),
        "the conffile has active rules: {parsed}"
    );

    for script in ["postinst", "prerm", "postrm"] {
        let path = pkg.control.join(script);
        let mode = fs::metadata(&path)
            .unwrap_or_else(|e| panic!("{script}: {e}"))
            .permissions()
            .mode();
        assert_eq!(mode & 0o111, 0o111, "{script} is not executable");
        run(Command::new("sh").arg("-n").arg(&path));
    }
    // A fresh install starts nothing: the postinst only restarts on an upgrade ($2 set), and
    // never enables the unit.
    let postinst = fs::read_to_string(pkg.control.join("postinst")).unwrap();
    assert!(!postinst.contains("systemctl enable"), "{postinst}");
    assert!(
        postinst.contains(r#"if [ -n "$2" ] && systemctl is-active"#),
        "{postinst}"
    );
}

#[test]
fn unit_passes_systemd_analyze_verify() {
    let pkg = package();
    // verify checks that ExecStart's binary exists and that every Documentation= man page opens:
    // point both at the unpacked package.
    let dir = pkg.root.parent().unwrap().join("unit");
    fs::create_dir_all(&dir).unwrap();
    let unit = fs::read_to_string(pkg.root.join("lib/systemd/system/ratelimit.service")).unwrap();
    let unit = unit.replace(
        "/usr/sbin/ratelimit",
        &pkg.root.join("usr/sbin/ratelimit").display().to_string(),
    );
    let path = dir.join("ratelimit.service");
    fs::write(&path, unit).unwrap();
    let out = run(Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .env("MANPATH", pkg.root.join("usr/share/man"))
        .env("SYSTEMD_LOG_LEVEL", "notice"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("ratelimit.service"),
        "systemd-analyze verify complains:\n{stderr}"
    );
}

/// The subcommands `ratelimit help` lists (and `rules`' own), each of which has a page.
fn subcommand_pages(binary: &Path) -> Vec<String> {
    let commands = |args: &[&str]| -> Vec<String> {
        let help = stdout(Command::new(binary).args(args).arg("--help"));
        help.lines()
            .skip_while(|l| !l.starts_with("Commands:"))
            .skip(1)
            .take_while(|l| l.starts_with("  "))
            .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
            .filter(|c| c != "help")
            .collect()
    };
    let mut pages = vec!["ratelimit".to_owned()];
    for sub in commands(&[]) {
        pages.push(format!("ratelimit-{sub}"));
        for subsub in commands(&[&sub]) {
            pages.push(format!("ratelimit-{sub}-{subsub}"));
        }
    }
    pages
}

#[test]
fn every_man_page_renders_without_warnings() {
    let pkg = package();
    let binary = pkg.root.join("usr/sbin/ratelimit");
    let mut pages: Vec<PathBuf> = subcommand_pages(&binary)
        .iter()
        .map(|p| pkg.root.join(format!("usr/share/man/man8/{p}.8.gz")))
        .collect();
    assert!(pages.len() > 10, "{pages:?}");
    pages.push(pkg.root.join("usr/share/man/man5/ratelimit.toml.5.gz"));
    let shipped = fs::read_dir(pkg.root.join("usr/share/man/man8"))
        .unwrap()
        .count()
        + 1;
    assert_eq!(
        shipped,
        pages.len(),
        "pages shipped vs subcommands: {pages:?}"
    );
    for page in &pages {
        assert!(page.exists(), "missing man page {}", page.display());
        let out = run(Command::new("man")
            .args(["--warnings=all", "-E", "UTF-8", "-l"])
            .arg(page)
            .env("MANWIDTH", "80")
            .env("MAN_KEEP_FORMATTING", "0"));
        // grotty's overstrike bold (`N\bN`) undone.
        let mut text = String::new();
        for c in String::from_utf8_lossy(&out.stdout).chars() {
            if c == '\u{8}' {
                text.pop();
            } else {
                text.push(c);
            }
        }
        let warnings = String::from_utf8_lossy(&out.stderr);
        assert!(warnings.trim().is_empty(), "{}: {warnings}", page.display());
        // man passes groff's warnings about unknown macros over; groff itself with every warning on.
        let groff = run(Command::new("sh")
            .arg("-c")
            .arg("gzip -dc \"$0\" | groff -man -ww -z -Tutf8")
            .arg(page));
        let warnings = String::from_utf8_lossy(&groff.stderr);
        assert!(warnings.trim().is_empty(), "{}: {warnings}", page.display());
        assert!(
            text.contains("NAME") && text.contains("DESCRIPTION"),
            "{}:\n{text}",
            page.display()
        );
    }
}

fn have(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn completion_scripts_parse_and_complete() {
    let pkg = package();
    let bash = pkg
        .root
        .join("usr/share/bash-completion/completions/ratelimit");
    run(Command::new("bash").arg("-n").arg(&bash));
    // Loaded, it completes the subcommands.
    let words = stdout(Command::new("bash").arg("-c").arg(format!(
        "source {}; COMP_WORDS=(ratelimit ru); COMP_CWORD=1; COMP_LINE='ratelimit ru'; COMP_POINT=12; \
         _ratelimit ratelimit ru ratelimit; printf '%s\\n' \"${{COMPREPLY[@]}}\"",
        bash.display()
    )));
    assert_eq!(
        words.trim(),
        "rules",
        "bash completion of `ratelimit ru`: {words:?}"
    );
    for (shell, path) in [
        ("zsh", "usr/share/zsh/vendor-completions/_ratelimit"),
        ("fish", "usr/share/fish/vendor_completions.d/ratelimit.fish"),
    ] {
        if !have(shell) {
            eprintln!("{shell} not installed (`cargo xtask setup` installs it): not checked");
            continue;
        }
        run(Command::new(shell).arg("-n").arg(pkg.root.join(path)));
    }
}

/// Every `ratelimit_*` metric name in `text`, with the `_total`/`_info` suffix the exposition
/// adds taken off.
fn metric_names(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("ratelimit_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        let base = name
            .strip_suffix("_total")
            .or_else(|| name.strip_suffix("_info"))
            .unwrap_or(name);
        names.push(base.to_owned());
        rest = &tail[end..];
    }
    names.sort();
    names.dedup();
    names
}

fn assert_exported(names: &[String], what: &str) {
    let dir = workspace().join("ratelimit-userspace/src/metrics");
    let source: String = ["mod.rs", "encode.rs"]
        .iter()
        .map(|f| fs::read_to_string(dir.join(f)).unwrap())
        .collect();
    for name in names {
        assert!(
            source.contains(&format!("\"{name}\"")),
            "{what} uses {name}, which the agent does not export (ratelimit-userspace/src/metrics/)"
        );
    }
}

fn promtool() -> &'static str {
    assert!(
        have("promtool"),
        "promtool missing: `cargo xtask setup` installs it"
    );
    "promtool"
}

#[test]
fn alert_rules_pass_promtool_and_name_exported_metrics() {
    let rules = workspace().join("packaging/prometheus/ratelimit-alerts.yml");
    run(Command::new(promtool())
        .args(["check", "rules"])
        .arg(&rules));
    let text = fs::read_to_string(&rules).unwrap();
    let names = metric_names(&text);
    assert!(names.len() >= 4, "{names:?}");
    assert_exported(&names, "ratelimit-alerts.yml");
    for wanted in [
        "up{",
        "ratelimit_buckets_capacity",
        "ratelimit_cluster_peers",
    ] {
        assert!(text.contains(wanted), "no alert on {wanted}");
    }
}

#[test]
fn dashboard_queries_parse_and_name_exported_metrics() {
    let path = workspace().join("packaging/grafana/ratelimit-dashboard.json");
    let dashboard: serde_json::Value = serde_json::from_str(&fs::read_to_string(&path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let panels = dashboard["panels"].as_array().expect("panels");
    let mut exprs = Vec::new();
    let mut ids = std::collections::HashSet::new();
    for panel in panels {
        assert!(
            ids.insert(panel["id"].as_u64().expect("panel id")),
            "duplicate panel id"
        );
        for target in panel["targets"].as_array().expect("targets") {
            exprs.push(target["expr"].as_str().expect("expr").to_owned());
        }
    }
    assert!(exprs.len() >= 10, "{exprs:?}");
    // promtool parses PromQL in rule files: every query becomes a recording rule, with Grafana's
    // variables replaced by what they expand to.
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, expr) in exprs.iter().enumerate() {
        let expr = expr
            .replace("$__rate_interval", "1m")
            .replace("$instance", ".*")
            .replace("$job", ".*")
            .replace("$rule", ".*");
        rules.push_str(&format!(
            "      - record: dashboard:query_{i}\n        expr: {}\n",
            serde_json::to_string(&expr).unwrap()
        ));
    }
    let file = std::env::temp_dir().join(format!("rl-dashboard-{}.yml", std::process::id()));
    fs::write(&file, &rules).unwrap();
    let out = Command::new(promtool())
        .args(["check", "rules"])
        .arg(&file)
        .output()
        .unwrap();
    let _ = fs::remove_file(&file);
    assert!(
        out.status.success(),
        "dashboard queries do not parse:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let names = metric_names(&exprs.join("\n"));
    assert_exported(&names, "the dashboard");
    for wanted in [
        "ratelimit_rule_packets",
        "ratelimit_buckets_tracked",
        "ratelimit_buckets_capacity",
        "ratelimit_bucket_evictions",
        "ratelimit_cluster_peers",
        "ratelimit_cluster_sync_lag_seconds",
        "ratelimit_shape_drops",
        "ratelimit_learned_peak_rate",
        "ratelimit_learned_burst",
        "ratelimit_learned_sources",
    ] {
        assert!(names.iter().any(|n| n == wanted), "no panel shows {wanted}");
    }
    assert_label_values_exported(&exprs.join("\n"));
}

/// Every exact label matcher of `text` (`window="10s"`, `quantile="0.99"`) selects a value the
/// agent writes: a string literal of the metrics' encoder or of the learner's quantile labels.
/// A panel whose matcher names a value never exported shows nothing, and promtool accepts it.
fn assert_label_values_exported(text: &str) {
    let root = workspace().join("ratelimit-userspace/src");
    let source: String = ["metrics/mod.rs", "metrics/encode.rs", "learn/mod.rs"]
        .iter()
        .map(|f| fs::read_to_string(root.join(f)).unwrap())
        .collect();
    let mut matchers = 0;
    let mut rest = text;
    while let Some(at) = rest.find("=\"") {
        let (before, after) = rest.split_at(at);
        rest = &after[2..];
        if before.ends_with(['=', '!', '~']) {
            continue;
        }
        let label = before
            .rsplit(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .next()
            .unwrap_or_default();
        let value = &rest[..rest.find('"').expect("a closing quote")];
        if value.contains('$') {
            continue;
        }
        matchers += 1;
        assert!(
            source.contains(&format!("\"{value}\"")),
            "the dashboard selects {label}=\"{value}\", which the agent never exports"
        );
    }
    assert!(matchers >= 4, "{matchers} exact matchers checked");
}
