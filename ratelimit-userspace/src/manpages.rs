//! Man pages, written by `ratelimit manpages DIR` (hidden; `cargo xtask package` runs it): the
//! command's from its clap definition (`ratelimit(8)` and one page per subcommand, e.g.
//! `ratelimit-rules-add(8)`), and the config file's, `ratelimit.toml(5)`, which is written by hand
//! in `man/ratelimit.toml.5` because no parser definition holds its prose.

use std::{
    fs, io,
    path::{Path, PathBuf},
};

/// `ratelimit.toml(5)`, roff source.
pub const CONFIG_PAGE: &str = include_str!("../man/ratelimit.toml.5");

/// Writes every page into `dir` (created if missing) and returns their paths: `ratelimit.8`,
/// `ratelimit-SUB.8` for every visible subcommand at any depth, and `ratelimit.toml.5`.
///
/// # Errors
/// If `dir` cannot be created or a page cannot be written.
pub fn write_all(cmd: &clap::Command, dir: &Path) -> io::Result<Vec<PathBuf>> {
    fs::create_dir_all(dir)?;
    let mut cmd = cmd.clone();
    // Subcommands only learn their full `bin_name` (`ratelimit rules add`) when built.
    cmd.build();
    let mut written = Vec::new();
    page(&cmd, cmd.get_name(), dir, &mut written)?;
    let path = dir.join("ratelimit.toml.5");
    fs::write(&path, CONFIG_PAGE)?;
    written.push(path);
    Ok(written)
}

fn page(cmd: &clap::Command, name: &str, dir: &Path, written: &mut Vec<PathBuf>) -> io::Result<()> {
    let mut roff = Vec::new();
    clap_mangen::Man::new(cmd.clone().name(name.to_owned()))
        .section("8")
        .manual("ratelimit manual")
        .source(format!("ratelimit {}", env!("CARGO_PKG_VERSION")))
        .render(&mut roff)?;
    let path = dir.join(format!("{name}.8"));
    fs::write(&path, roff)?;
    written.push(path);
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        // `help` is clap's own; its page would only say to use --help.
        if sub.get_name() == "help" {
            continue;
        }
        page(sub, &format!("{name}-{}", sub.get_name()), dir, written)?;
    }
    Ok(())
}
