use std::fs;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::Value;

use std::collections::BTreeMap;

use super::fixtures::{SLICE, SVC, dir_with};
use super::*;
use crate::core::domain::ServiceKey;
use crate::core::inputs::manifests::LastGood;

fn names(m: &Manifests) -> (Vec<String>, Vec<String>) {
    let key = |meta: &ObjectMeta| {
        format!("{}/{}", meta.namespace.clone().unwrap_or_default(), meta.name.clone().unwrap_or_default())
    };
    (
        m.services.iter().map(|s| key(&s.metadata)).collect(),
        m.slices.iter().map(|s| key(&s.metadata)).collect(),
    )
}

#[test]
fn a_broken_file_keeps_its_last_good_content_and_a_deleted_one_goes() {
    let dir = dir_with(&[("web.yaml", SVC), ("slice.yaml", SLICE)]);
    let mut last = LastGood::default();
    let m = last.apply(load_dir(dir.path()).expect("load"));
    assert_eq!(names(&m).0, vec!["default/web".to_string()]);

    // Half-edited: the Service stays as it was, and the problem says so.
    fs::write(dir.path().join("web.yaml"), "apiVersion: v1\nkind: Service\nmetadata: {name: [oops\n")
        .unwrap();
    let m = last.apply(load_dir(dir.path()).expect("load"));
    assert_eq!(names(&m).0, vec!["default/web".to_string()], "{:?}", m.problems);
    assert!(m.problems.iter().any(|p| p.message.contains("last good")), "{:?}", m.problems);
    assert_eq!(names(&m).1, vec!["prod/web-1".to_string()]);

    // Fixed with another name: the new content wins.
    fs::write(dir.path().join("web.yaml"), SVC.replace("name: web", "name: web2")).unwrap();
    let m = last.apply(load_dir(dir.path()).expect("load"));
    assert_eq!(names(&m).0, vec!["default/web2".to_string()]);

    // Deleted: gone, even though it was good before.
    fs::remove_file(dir.path().join("web.yaml")).unwrap();
    let m = last.apply(load_dir(dir.path()).expect("load"));
    assert!(names(&m).0.is_empty());

    // A file that was never good serves what could be read of it.
    let bad_second = format!("{SVC}---\nkind: Service\nmetadata: {{name: [oops\n");
    fs::write(dir.path().join("new.yaml"), bad_second).unwrap();
    let m = last.apply(load_dir(dir.path()).expect("load"));
    assert_eq!(names(&m).0, vec!["default/web".to_string()]);
}

/// A FIFO named like a manifest (a read of it would wait for a writer forever) is a named
/// problem at once, and the other files are served.
#[test]
fn a_fifo_among_the_manifests_is_a_problem_not_a_stuck_read() {
    let dir = dir_with(&[("web.yaml", SVC)]);
    nix::unistd::mkfifo(&dir.path().join("pipe.yaml"), nix::sys::stat::Mode::S_IRWXU).expect("mkfifo");
    let started = std::time::Instant::now();
    let loaded = load_dir(dir.path()).expect("the directory reads");
    assert!(started.elapsed() < std::time::Duration::from_secs(2), "a read waited");
    assert_eq!(loaded.services.len(), 1);
    let problems: Vec<String> = loaded.problems.iter().map(|p| p.to_string()).collect();
    assert!(
        problems.iter().any(|p| p.contains("pipe.yaml") && p.contains("is a FIFO, not a regular file")),
        "{problems:?}"
    );
}

#[test]
fn multi_document_and_defaults() {
    let text = format!("# leading comment\n---\n{SVC}---\n# only a comment\n---\n{SLICE}...\n");
    let dir = dir_with(&[("a.yaml", &text)]);
    let m = load_dir(dir.path()).expect("load");
    assert!(m.problems.is_empty(), "{:?}", m.problems);
    assert_eq!(names(&m), (vec!["default/web".to_string()], vec!["prod/web-1".to_string()]));
}

#[test]
fn problems_are_per_document_with_file_lines() {
    let bad_syntax = "apiVersion: v1\nkind: Service\nmetadata: {name: [oops\n";
    let bad_type =
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: typed\nspec:\n  ports:\n  - port: eighty\n";
    let text = format!("{SVC}---\n{bad_syntax}---\n{bad_type}---\n{SLICE}");
    let dir = dir_with(&[("m.yaml", &text)]);
    let m = load_dir(dir.path()).expect("load");
    assert_eq!(names(&m).0, vec!["default/web".to_string()]);
    assert_eq!(names(&m).1, vec!["prod/web-1".to_string()], "a bad document does not stop the next");
    assert_eq!(m.problems.len(), 2, "{:?}", m.problems);
    let p = &m.problems[0];
    assert_eq!((p.document, p.file.file_name().and_then(|f| f.to_str())), (2, Some("m.yaml")));
    // The broken flow sequence starts on line 12 of the file; libyaml notices it at or after.
    assert!(p.line.is_some_and(|l| (12..=13).contains(&l)), "{p}");
    let p = &m.problems[1];
    assert_eq!(p.document, 3);
    assert_eq!(p.line, Some(20), "{p}");
    assert!(p.message.contains("invalid Service"), "{p}");
    let shown = p.to_string();
    assert!(shown.contains("m.yaml document 3 (line 20): invalid Service"), "{shown}");
    // The wrongly typed Service still names itself: it gets a status line of its own.
    let invalid: Vec<String> = m.invalid_services.iter().map(|i| i.key.to_string()).collect();
    assert_eq!(invalid, ["default/typed"], "the unparsable one has no name");
    assert_eq!(m.invalid_services[0].problem, m.problems[1]);
}

#[test]
fn services_served_from_a_last_good_file_say_so() {
    let dir = dir_with(&[("m.yaml", SVC)]);
    let mut lg = LastGood::default();
    assert!(lg.apply(load_dir(dir.path()).expect("load")).stale.is_empty());
    std::fs::write(dir.path().join("m.yaml"), format!("{SVC}  - port: eighty\n")).unwrap();
    let m = lg.apply(load_dir(dir.path()).expect("load"));
    assert_eq!(names(&m).0, vec!["default/web".to_string()], "kept: {:?}", m.problems);
    let note = m.stale.get(&ServiceKey::new("default", "web")).expect("a note for default/web");
    assert!(note.contains("last good version") && note.contains("m.yaml"), "{note}");
}

#[test]
fn kinds_and_versions() {
    let files = [
        ("a.yaml", "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: cfg\n"),
        ("b.yaml", "apiVersion: v1beta1\nkind: Service\nmetadata:\n  name: old\n"),
        ("c.yaml", "apiVersion: v1\nmetadata:\n  name: nokind\n"),
        ("d.yaml", "- just\n- a list\n"),
        ("e.yaml", "apiVersion: v1\nkind: Service\nmetadata:\n  namespace: x\nspec: {}\n"),
        ("f.yaml", SVC),
        ("g.yaml", SVC), // duplicate of f.yaml
    ];
    let dir = dir_with(&files);
    let m = load_dir(dir.path()).expect("load");
    assert_eq!(m.services.len(), 1);
    assert_eq!(m.ignored.len(), 1);
    let ignored = m.ignored[0].to_string();
    assert!(
        ignored.starts_with("ignored kind ConfigMap (v1) \"cfg\" in ")
            && ignored.ends_with("a.yaml document 1"),
        "{ignored}"
    );
    let msgs: Vec<String> = m.problems.iter().map(ToString::to_string).collect();
    assert_eq!(msgs.len(), 5, "{msgs:?}");
    let expect = [
        ("b.yaml", "unsupported apiVersion \"v1beta1\""),
        ("c.yaml", "no kind"),
        ("d.yaml", "found a list"),
        ("e.yaml", "no metadata.name"),
        ("g.yaml", "duplicate Service default/web"),
    ];
    for ((file, needle), msg) in expect.iter().zip(&msgs) {
        assert!(msg.contains(file) && msg.contains(needle), "{msg} lacks {file}/{needle}");
    }
}

#[test]
fn json_and_lists() {
    let json = r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"j","namespace":"ns"},"spec":{"ports":[{"port":53,"protocol":"UDP"}]}}"#;
    let bad_json =
        "{\n  \"apiVersion\": \"v1\",\n  \"kind\": \"Service\",\n  \"metadata\": {\"name\": 5}\n}\n";
    let list = format!(
        "apiVersion: v1\nkind: List\nitems:\n- {}\n- apiVersion: v1\n  kind: Secret\n  metadata: {{name: s}}\n- apiVersion: v1\n  kind: Service\n  metadata: {{name: bad}}\n  spec: {{ports: [{{port: x}}]}}\n",
        serde_json::to_string(&serde_saphyr::from_str::<Value>(SLICE).expect("slice")).expect("json")
    );
    let svc_list = "apiVersion: v1\nkind: ServiceList\nitems:\n- metadata: {name: from-list}\n  spec: {type: LoadBalancer, ports: [{port: 1}]}\n";
    let dir = dir_with(&[("j.json", json), ("k.json", bad_json), ("l.yml", &list), ("s.yaml", svc_list)]);
    let m = load_dir(dir.path()).expect("load");
    assert_eq!(
        names(&m),
        (vec!["ns/j".to_string(), "default/from-list".to_string()], vec!["prod/web-1".to_string()])
    );
    assert_eq!(m.ignored.len(), 1);
    assert_eq!(m.ignored[0].kind, "Secret");
    let msgs: Vec<String> = m.problems.iter().map(ToString::to_string).collect();
    assert_eq!(msgs.len(), 2, "{msgs:?}");
    assert!(msgs[0].contains("k.json document 1 (line 4)"), "{}", msgs[0]);
    assert!(msgs[1].contains("l.yml document 1: items[2]: invalid Service"), "{}", msgs[1]);
}

/// NodePortPools in DIR: parsed (YAML, JSON, in a List), cluster-scoped, a document that
/// does not parse is its file's problem (the file's last good version serves), and the
/// pool decisions are those of Kubernetes mode against `--node-labels`: an invalid pool
/// names its file, object and value and its last valid version stays in force.
#[test]
fn pools_in_the_directory_go_through_the_pool_decisions() {
    use crate::core::decisions::pool::LastValid;
    use crate::core::decisions::port_policy::PortRange;
    const EDGE: &str = "apiVersion: nodelb.io/v1alpha1\nkind: NodePortPool\nmetadata:\n  name: edge\n  namespace: ignored\nspec:\n  ports: [{start: 21000, end: 21009}]\n  nodeSelector: {matchLabels: {zone: a}}\n";
    let list = r#"{"apiVersion":"v1","kind":"List","items":[{"apiVersion":"nodelb.io/v1alpha1","kind":"NodePortPool","metadata":{"name":"any"},"spec":{"ports":[{"start":22000,"end":22000}],"priority":5}}]}"#;
    let dir = dir_with(&[("edge.yaml", EDGE), ("list.json", list), ("web.yaml", SVC)]);
    let flags = PortRange { first: 20000, last: 29999 };
    let zone = |z: &str| BTreeMap::from([("zone".to_string(), z.to_string())]);
    let mut last_good = LastGood::default();
    let mut last_valid = LastValid::default();
    let mut read = |labels: &BTreeMap<String, String>, last_valid: &mut LastValid| {
        let m = last_good.apply(load_dir(dir.path()).expect("load"));
        let (ctx, problems) =
            crate::core::inputs::manifests::pool_context(&m, last_valid, flags, labels, true);
        let mut all: Vec<String> = m.problems.iter().map(ToString::to_string).collect();
        all.extend(problems);
        (m, ctx, all)
    };

    let (m, ctx, problems) = read(&zone("a"), &mut last_valid);
    assert!(problems.is_empty(), "{problems:?}");
    let names: Vec<_> = m.pools.iter().map(|p| p.metadata.name.clone().unwrap()).collect();
    assert_eq!(names, ["edge", "any"]);
    assert!(m.pools.iter().all(|p| p.metadata.namespace.is_none()), "cluster-scoped");
    assert!(!ctx.set.implicit);
    assert_eq!(ctx.node_labels, zone("a"), "this node's labels, for nodeSelector");
    assert_eq!(ctx.set.get("edge").unwrap().effective, vec![PortRange { first: 21000, last: 21009 }]);

    // Invalid for nodelb (the schema would allow it): named with file, object and value; the
    // last valid version stays in force.
    let bad = EDGE
        .replace("matchLabels: {zone: a}", "matchExpressions: [{key: zone, operator: Gt, values: [\"1\"]}]");
    fs::write(dir.path().join("edge.yaml"), bad).unwrap();
    let (_, ctx, problems) = read(&zone("a"), &mut last_valid);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].contains(
            "edge.yaml: NodePortPool edge: spec.nodeSelector: expression on \"zone\": operator \"Gt\""
        ),
        "{}",
        problems[0]
    );
    assert!(ctx.set.get("edge").is_some(), "last valid version in force");
    // A read from scratch (a restart, `nodelb plan`) has no last valid version: not used.
    let (_, ctx, _) = read(&zone("a"), &mut LastValid::default());
    assert!(ctx.set.get("edge").is_none());

    // A document that does not parse as a pool: its file's problem, last good content kept.
    fs::write(dir.path().join("edge.yaml"), EDGE.replace("start: 21000", "start: many")).unwrap();
    let (m, ctx, problems) = read(&zone("b"), &mut last_valid);
    assert!(
        problems.iter().any(|p| p.contains("edge.yaml document 1") && p.contains("invalid NodePortPool")),
        "{problems:?}"
    );
    assert!(m.pools.iter().any(|p| p.metadata.name.as_deref() == Some("edge")), "last good edge.yaml");
    assert_eq!(ctx.node_labels, zone("b"));

    // Duplicate pool names across files: the first wins.
    fs::write(dir.path().join("edge.yaml"), EDGE).unwrap();
    fs::write(dir.path().join("zz.yaml"), EDGE).unwrap();
    let (m, _, problems) = read(&zone("a"), &mut last_valid);
    assert_eq!(m.pools.len(), 2);
    assert!(
        problems.iter().any(|p| p.contains("zz.yaml") && p.contains("duplicate NodePortPool \"edge\"")),
        "{problems:?}"
    );
}

#[test]
fn file_selection() {
    let dir =
        dir_with(&[(".hidden.yaml", SVC), ("notes.txt", "hello"), ("web.yaml.bak", SVC), ("z.yaml", SLICE)]);
    fs::create_dir(dir.path().join("sub.yaml")).expect("mkdir");
    fs::write(dir.path().join("sub.yaml/x.yaml"), SVC).expect("write");
    // ConfigMap volume layout: visible symlinks into a hidden, timestamped directory.
    fs::create_dir(dir.path().join("..2024_01_01")).expect("mkdir");
    fs::write(dir.path().join("..2024_01_01/web.yaml"), SVC).expect("write");
    std::os::unix::fs::symlink("..2024_01_01", dir.path().join("..data")).expect("symlink");
    std::os::unix::fs::symlink("..data/web.yaml", dir.path().join("web.yaml")).expect("symlink");
    std::os::unix::fs::symlink("nowhere.yaml", dir.path().join("dangling.yaml")).expect("symlink");
    let m = load_dir(dir.path()).expect("load");
    assert_eq!(names(&m), (vec!["default/web".to_string()], vec!["prod/web-1".to_string()]));
    assert_eq!(m.problems.len(), 1, "{:?}", m.problems);
    assert!(m.problems[0].to_string().contains("dangling.yaml: cannot read"), "{}", m.problems[0]);
}

#[test]
fn missing_dir_is_an_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let err = load_dir(&dir.path().join("nope")).expect_err("missing");
    assert!(err.to_string().contains("nope"), "{err}");
}

#[test]
fn cached_loading_equals_fresh_loading_across_edits() {
    let dir = dir_with(&[("a.yaml", SVC), ("b.yaml", SLICE)]);
    let mut cache = ManifestCache::default();
    let check = |cache: &mut ManifestCache, what: &str| {
        let cached = load_dir_cached(dir.path(), cache).expect("cached");
        let fresh = load_dir(dir.path()).expect("fresh");
        assert_eq!(names(&cached), names(&fresh), "{what}");
        let p = |m: &Manifests| m.problems.iter().map(|p| p.to_string()).collect::<Vec<_>>();
        assert_eq!(p(&cached), p(&fresh), "{what}");
        cached
    };
    check(&mut cache, "first load");
    fs::write(dir.path().join("a.yaml"), SVC.replace("name: web", "name: web2")).unwrap();
    let m = check(&mut cache, "modified");
    assert_eq!(names(&m).0, vec!["default/web2".to_string()]);
    // The same Service in a second file: a duplicate across files, the first file wins.
    fs::write(dir.path().join("c.yaml"), SVC.replace("name: web", "name: web2")).unwrap();
    let m = check(&mut cache, "duplicate across files");
    assert_eq!(names(&m).0, vec!["default/web2".to_string()]);
    assert!(
        m.problems.iter().any(|p| p.message.contains("duplicate Service default/web2")),
        "{:?}",
        m.problems
    );
    fs::rename(dir.path().join("a.yaml"), dir.path().join("z.yaml")).unwrap();
    check(&mut cache, "renamed");
    fs::remove_file(dir.path().join("z.yaml")).unwrap();
    fs::remove_file(dir.path().join("c.yaml")).unwrap();
    let m = check(&mut cache, "deleted");
    assert!(names(&m).0.is_empty());
    assert_eq!(cache.files.len(), 1, "deleted files leave the cache");
}
