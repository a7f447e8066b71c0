//! The documentation a user reads stays true to what they can run: every `gateway serve`
//! setting is in docs/operations.md, and every relative link in the README and docs/ leads to
//! a file (and a heading) that is there.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::common::gateway_binary;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Each `--flag` and `[env: VAR=]` that `gateway serve --help` lists.
fn serve_settings() -> BTreeSet<String> {
    let output = std::process::Command::new(gateway_binary())
        .args(["serve", "--help"])
        .env_clear()
        .output()
        .unwrap();
    assert!(output.status.success());
    let help = String::from_utf8(output.stdout).unwrap();
    let mut settings = BTreeSet::new();
    for word in help.split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == ']') {
        if let Some(flag) = word.strip_prefix("--")
            && !flag.is_empty()
            && flag != "help"
        {
            settings.insert(format!(
                "--{}",
                flag.trim_end_matches(|c: char| !c.is_alphanumeric())
            ));
        }
    }
    for part in help.split("[env: ").skip(1) {
        let variable = part.split(['=', ']']).next().unwrap();
        settings.insert(variable.to_owned());
    }
    settings
}

#[test]
fn every_serve_setting_is_in_the_operations_guide() {
    let guide = std::fs::read_to_string(root().join("docs/operations.md")).unwrap();
    let settings = serve_settings();
    assert!(
        settings.contains("DATABASE_URL") && settings.contains("--listen"),
        "{settings:?}"
    );
    let missing: Vec<_> = settings
        .iter()
        .filter(|setting| !guide.contains(&format!("`{setting}`")))
        .collect();
    assert!(missing.is_empty(), "not in docs/operations.md: {missing:?}");
}

/// GitHub's anchor for a heading: lower case, spaces to dashes, punctuation dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn anchors(file: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(file).unwrap_or_default();
    text.lines()
        .filter_map(|line| line.strip_prefix('#'))
        .map(|heading| anchor(heading.trim_start_matches('#')))
        .collect()
}

/// Every `](target)` of `text` that is not a URL.
fn relative_links(text: &str) -> Vec<String> {
    text.split("](")
        .skip(1)
        .filter_map(|rest| rest.split(')').next())
        .filter(|target| !target.contains("://") && !target.starts_with("mailto:"))
        .map(str::to_owned)
        .collect()
}

#[test]
fn every_relative_link_in_the_readme_and_docs_resolves() {
    let mut files = vec![
        root().join("README.md"),
        root().join("BENCHMARKS.md"),
        root().join("CONTRIBUTING.md"),
    ];
    for dir in ["docs", "docs/bench"] {
        for entry in std::fs::read_dir(root().join(dir)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|ext| ext == "md") {
                files.push(path);
            }
        }
    }
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for link in relative_links(&text) {
            checked += 1;
            let (path, fragment) = link.split_once('#').unwrap_or((&link, ""));
            let target = if path.is_empty() {
                file.clone()
            } else {
                file.parent().unwrap().join(path)
            };
            if !target.exists() {
                broken.push(format!("{}: {link}", file.display()));
            } else if !fragment.is_empty()
                && target.extension().is_some_and(|ext| ext == "md")
                && !anchors(&target).contains(fragment)
            {
                broken.push(format!("{}: {link} (no such heading)", file.display()));
            }
        }
    }
    assert!(checked > 30, "only {checked} links read");
    assert!(broken.is_empty(), "broken links: {broken:#?}");
}
