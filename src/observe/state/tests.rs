use super::*;
use crate::core::domain::Protocol;

fn mode(path: &Path) -> u32 {
    fs::metadata(path).expect("stat").permissions().mode() & 0o777
}

/// Root only, whatever the umask and whatever mode an older file or a leftover temporary
/// file had; a directory nodelb creates is 0700.
#[test]
fn the_state_file_is_readable_by_root_only() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("new/sub/state.json");
    let mut file = StateFile::new(&path);
    file.save(&sample()).expect("save");
    assert_eq!(mode(&path), 0o600, "new file");
    assert_eq!(mode(&dir.path().join("new")), 0o700, "created directory");
    assert_eq!(mode(&dir.path().join("new/sub")), 0o700, "created directory");
    let old = dir.path().join("old.json");
    fs::write(&old, "{}").expect("write");
    fs::set_permissions(&old, fs::Permissions::from_mode(0o644)).expect("chmod");
    let tmp = dir.path().join(format!(".old.json.tmp.{}", std::process::id()));
    fs::write(&tmp, "partial").expect("write");
    fs::set_permissions(&tmp, fs::Permissions::from_mode(0o666)).expect("chmod");
    StateFile::new(&old).save(&sample()).expect("save");
    assert_eq!(mode(&old), 0o600, "replaced file");
    assert_eq!(StateFile::new(&old).load().expect("load"), sample());
}

fn t(secs: i64) -> Timestamp {
    Timestamp::from_second(1_700_000_000 + secs).unwrap()
}

fn sample() -> State {
    let allocations = sample_allocations();
    let since = allocations.keys().enumerate().map(|(i, k)| (k.clone(), t(i as i64))).collect();
    State { allocations, since }
}

/// The Services that have a `since` in the file at `path`.
fn v_since(path: &Path) -> Vec<String> {
    let v: serde_json::Value = serde_json::from_str(&fs::read_to_string(path).expect("read")).expect("json");
    v["since"].as_object().map(|o| o.keys().cloned().collect()).unwrap_or_default()
}

fn sample_allocations() -> Allocations {
    let mut a = Allocations::new();
    a.insert(
        ServiceKey { namespace: "default".into(), name: "web".into() },
        BTreeMap::from([(PortId { port: 80, protocol: Protocol::Tcp }, 20001)]),
    );
    a.insert(
        ServiceKey { namespace: "kube-system".into(), name: "dns".into() },
        BTreeMap::from([
            (PortId { port: 53, protocol: Protocol::Udp }, 20002),
            (PortId { port: 53, protocol: Protocol::Tcp }, 20002),
        ]),
    );
    a
}

/// A state file holding `state` in a new directory (kept while the first value lives).
fn saved(state: &State) -> (tempfile::TempDir, PathBuf, StateFile) {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("state.json");
    let mut file = StateFile::new(&path);
    file.save(state).expect("save");
    (dir, path, file)
}

fn key(ns: &str, name: &str) -> ServiceKey {
    ServiceKey { namespace: ns.into(), name: name.into() }
}

fn tcp(port: u16) -> PortId {
    PortId { port, protocol: Protocol::Tcp }
}

/// `sample()` with `default/web` on another node port and a new time, `kube-system/dns` gone
/// and `default/new` added.
fn changed() -> State {
    let mut s = sample();
    s.allocations.insert(key("default", "web"), BTreeMap::from([(tcp(80), 20005)]));
    s.since.insert(key("default", "web"), t(100));
    s.allocations.remove(&key("kube-system", "dns"));
    s.since.remove(&key("kube-system", "dns"));
    s.allocations.insert(key("default", "new"), BTreeMap::from([(tcp(443), 20007)]));
    s.since.insert(key("default", "new"), t(200));
    s
}

/// A change is one journal line per Service whose entry changed, replayed on load; the file
/// itself is not written; nothing changed appends nothing; the journal is root's only.
#[test]
fn a_change_is_journal_lines_replayed_on_load() {
    let (_dir, path, mut file) = saved(&sample());
    let whole = fs::read(&path).expect("read");
    file.save_change(&sample(), &changed()).expect("save change");
    assert_eq!(fs::read(&path).expect("read"), whole, "the file is not written");
    let journal = fs::read_to_string(file.journal_path()).expect("journal");
    assert_eq!(
        journal,
        concat!(
            r#"{"journal":1}"#,
            "\n",
            r#"{"service":"default/new","ports":{"443/TCP":20007},"since":"2023-11-14T22:16:40Z"}"#,
            "\n",
            r#"{"service":"default/web","ports":{"80/TCP":20005},"since":"2023-11-14T22:15:00Z"}"#,
            "\n",
            r#"{"service":"kube-system/dns"}"#,
            "\n",
            r#"{"end":3}"#,
            "\n",
        )
    );
    assert_eq!(mode(&file.journal_path()), 0o600);
    assert_eq!(StateFile::new(&path).load().expect("load"), changed());
    file.save_change(&changed(), &changed()).expect("no change");
    assert_eq!(fs::read_to_string(file.journal_path()).expect("journal"), journal);

    // Folded in: the file whole, the journal gone, the same state.
    let mut again = StateFile::new(&path);
    let loaded = again.load().expect("load");
    again.fold_journal(&loaded).expect("fold");
    assert!(!again.journal_path().exists());
    assert_eq!(StateFile::new(&path).load().expect("load"), changed());
    assert_eq!(v_since(&path), ["default/new", "default/web"]);
}

/// Once the journal holds more lines than a quarter of the Services (at least
/// MIN_JOURNAL_LINES), a change writes the file whole and removes the journal.
#[test]
fn a_long_journal_is_folded_into_the_file() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("state.json");
    let mut file = StateFile::new(&path);
    let many = |port: u16| {
        let allocations: Allocations = (0..MIN_JOURNAL_LINES * 3 / 4)
            .map(|i| (key("default", &format!("svc-{i}")), BTreeMap::from([(tcp(80), port)])))
            .collect();
        State { since: allocations.keys().map(|k| (k.clone(), t(0))).collect(), allocations }
    };
    file.save_change(&State::default(), &sample()).expect("no file yet");
    assert!(path.is_file() && !file.journal_path().exists(), "the first allocations: written whole");
    file.save(&State::default()).expect("an empty file");
    file.save_change(&State::default(), &many(20001)).expect("first");
    assert!(file.journal_path().exists());
    assert_eq!(StateFile::new(&path).load().expect("the file and journal"), many(20001));
    fs::remove_file(&path).expect("the file gone");
    let (alone, skipped) = StateFile::new(&path).load_lenient().expect("the journal alone");
    assert_eq!((alone, skipped.len()), (State::default(), 1), "a journal without its file follows nothing");
    fs::write(&path, r#"{"version":1,"allocations":{}}"#).expect("an unnumbered file");
    fs::write(file.journal_path(), "{\"service\":\"default/a\",\"ports\":{\"80/TCP\":20001}}\n{\"end\":1}\n")
        .expect("a journal without its first line");
    let (none, skipped) = StateFile::new(&path).load_lenient().expect("a headerless journal");
    assert_eq!((none, skipped.len()), (State::default(), 1), "a journal without a header is not replayed");
    fs::remove_file(&path).expect("the file gone");
    fs::write(file.journal_path(), "").expect("an empty journal");
    let (empty, skipped) = StateFile::new(&path).load_lenient().expect("an empty journal");
    assert_eq!((empty, skipped.len()), (State::default(), 0), "an empty journal is no journal");
    file.save(&State::default()).expect("an empty file");
    file.save_change(&State::default(), &many(20001)).expect("first");
    file.save_change(&many(20001), &many(20002)).expect("second");
    assert!(!file.journal_path().exists(), "folded");
    assert_eq!(StateFile::new(&path).load().expect("load"), many(20002));
}

/// A crash after the file was written whole but before the journal was removed: the
/// journal follows the write before and is not replayed (its `default/web` line would undo
/// the later change of it); named.
#[test]
fn a_journal_left_beside_a_later_write_is_not_replayed() {
    let (_dir, path, mut file) = saved(&sample());
    file.save_change(&sample(), &changed()).expect("change");
    let journal = fs::read(file.journal_path()).expect("journal");
    let mut later = changed();
    later.allocations.insert(key("default", "web"), BTreeMap::from([(tcp(80), 20011)]));
    file.save(&later).expect("written whole");
    assert!(!file.journal_path().exists());
    fs::write(file.journal_path(), journal).expect("the journal back");
    let (loaded, skipped) = StateFile::new(&path).load_lenient().expect("load");
    assert_eq!(loaded, later);
    let skipped: Vec<String> = skipped.iter().map(ToString::to_string).collect();
    assert_eq!(skipped.len(), 1, "{skipped:?}");
    assert!(skipped[0].contains("follows write 1 of the file, which is write 2"), "{skipped:?}");

    // The next change starts a new journal (not appended to the old one).
    let mut file = StateFile::new(&path);
    let loaded = file.load().expect("load");
    let mut next = loaded.clone();
    next.allocations.remove(&key("default", "new"));
    next.since.remove(&key("default", "new"));
    file.save_change(&loaded, &next).expect("change");
    let journal = fs::read_to_string(file.journal_path()).expect("journal");
    assert_eq!(journal, "{\"journal\":2}\n{\"service\":\"default/new\"}\n{\"end\":1}\n");
    assert_eq!(StateFile::new(&path).load().expect("load"), next);
}

/// A reader beside the agent (`nodelb plan`) that meets a fold between its two reads (the
/// journal read first, then the agent writes the file whole and removes it) sees the change
/// once: the journal it read follows the write before the file it reads, which holds it.
#[test]
fn a_fold_between_the_reads_shows_every_change() {
    let (_dir, path, mut agent) = saved(&sample());
    agent.save_change(&sample(), &changed()).expect("change");
    let mut reader = StateFile::new(&path);
    let journal = reader.read_journal().expect("journal read");
    assert!(journal.is_some());
    let mut later = changed();
    later.allocations.insert(key("default", "web"), BTreeMap::from([(tcp(80), 20011)]));
    agent.save_change(&changed(), &later).expect("a later change");
    agent.fold_journal(&later).expect("the agent folds");
    let (loaded, skipped) = reader.load_with(journal).expect("load");
    assert_eq!(loaded, later, "the older journal's default/web line is not replayed over the file");
    assert_eq!(skipped.len(), 1, "{skipped:?}");
}

/// The agent's own files are never reached through a link someone planted: a link in the
/// state file's place is refused when read (the error names the file), one in its temporary
/// file's place is removed, not written through, and one in the journal's place fails the
/// append.
#[test]
fn links_in_the_state_files_places_are_not_followed() {
    let dir = tempfile::tempdir().expect("dir");
    let victim = dir.path().join("victim");
    fs::write(&victim, "precious").expect("write");
    let path = dir.path().join("state.json");
    std::os::unix::fs::symlink(&victim, &path).expect("symlink");
    let e = StateFile::new(&path).load().expect_err("a link").to_string();
    assert!(e.contains("state.json"), "{e}");
    fs::remove_file(&path).expect("rm");

    let tmp = dir.path().join(format!(".state.json.tmp.{}", std::process::id()));
    std::os::unix::fs::symlink(&victim, &tmp).expect("symlink");
    let mut file = StateFile::new(&path);
    file.save(&sample()).expect("written beside the link, not through it");
    assert_eq!(fs::read_to_string(&victim).expect("read"), "precious");
    assert_eq!(file.load().expect("load"), sample());

    std::os::unix::fs::symlink(&victim, file.journal_path()).expect("symlink");
    assert!(file.save_change(&sample(), &changed()).is_err(), "appended through a link");
    assert_eq!(fs::read_to_string(&victim).expect("read"), "precious");
}

/// After a rollback an older nodelb wrote the file without a number; the next whole write
/// is numbered above the journal a crash left (header 1), so that journal never follows it.
#[test]
fn a_whole_write_is_numbered_above_every_journal_seen() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("state.json");
    let mut file = StateFile::new(&path);
    file.save(&sample()).expect("write 1");
    file.save_change(&sample(), &changed()).expect("journal of write 1");
    let journal = fs::read(file.journal_path()).expect("journal");
    fs::write(&path, r#"{"version":1,"allocations":{"default/older":{"80/TCP":20003}}}"#)
        .expect("older nodelb");
    let mut file = StateFile::new(&path);
    let older = file.load().expect("load");
    assert_eq!(older.allocations.len(), 1, "the journal does not follow an unnumbered file");
    file.fold_journal(&older).expect("written whole");
    let v: serde_json::Value = serde_json::from_str(&fs::read_to_string(&path).expect("read")).expect("json");
    assert_eq!(v["journal"], 2, "above the journal's 1");
    fs::write(file.journal_path(), journal).expect("the journal back");
    assert_eq!(StateFile::new(&path).load().expect("load").allocations, older.allocations);
}

/// A failed whole write leaves a write due: the clean-shutdown fold writes the file even
/// without a journal, and so does the next change even when nothing changed.
#[test]
fn a_failed_write_leaves_a_whole_write_due() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("state.json");
    fs::create_dir(&path).expect("a directory where the file goes");
    let mut file = StateFile::new(&path);
    assert!(file.save(&sample()).is_err());
    assert!(file.write_due());
    fs::remove_dir(&path).expect("fixed");
    file.save_change(&sample(), &sample()).expect("nothing changed, written whole");
    assert!(!file.write_due());
    assert_eq!(StateFile::new(&path).load().expect("load"), sample());
    fs::remove_file(&path).expect("gone");
    fs::create_dir(&path).expect("a directory again");
    assert!(file.save(&changed()).is_err());
    fs::remove_dir(&path).expect("fixed");
    file.fold_journal(&changed()).expect("the fold writes it");
    assert_eq!(StateFile::new(&path).load().expect("load"), changed());
}

/// A torn last line (a crash while it was written) and a bad line are skipped and named;
/// the other lines are applied.
#[test]
fn bad_journal_lines_are_skipped_and_named() {
    let (_dir, path, file) = saved(&sample());
    fs::write(
        file.journal_path(),
        concat!(
            r#"{"journal":1}"#,
            "\n",
            r#"{"service":"default/new","ports":{"443/TCP":20007},"since":"2023-11-14T22:16:40Z"}"#,
            "\n",
            r#"{"service":"a/b/c","ports":{"80/TCP":1}}"#,
            "\n",
            r#"{"service":"default/web","ports":{"80/TCP":0,"81/TCP":20009}}"#,
            "\n",
            r#"{"end":3}"#,
            "\n",
            r#"{"service":"kube-system/dns"}"#,
            "\n",
            r#"{"end":1}"#,
            "\n",
            // A change cut short: not applied, not even its whole first line.
            r#"{"service":"default/later","ports":{"80/TCP":20010}}"#,
            "\n",
            r#"{"service":"default/torn","por"#,
        ),
    )
    .expect("journal");
    let (state, skipped) = StateFile::new(&path).load_lenient().expect("load");
    let mut want = sample();
    want.allocations.insert(key("default", "new"), BTreeMap::from([(tcp(443), 20007)]));
    want.since.insert(key("default", "new"), t(200));
    want.allocations.insert(key("default", "web"), BTreeMap::from([(tcp(81), 20009)]));
    want.since.remove(&key("default", "web"));
    want.allocations.remove(&key("kube-system", "dns"));
    want.since.remove(&key("kube-system", "dns"));
    assert_eq!(state, want);
    let skipped: Vec<String> = skipped.iter().map(ToString::to_string).collect();
    let journal = file.journal_path().display().to_string();
    assert_eq!(skipped.len(), 4, "{skipped:?}");
    assert!(skipped[0].starts_with(&format!("state journal {journal}: line 3: a/b/c: ")), "{skipped:?}");
    assert!(
        skipped[1].starts_with(&format!("state journal {journal}: line 4: default/web: 80/TCP: node port 0")),
        "{skipped:?}"
    );
    assert!(
        skipped[2].starts_with(&format!("state journal {journal}: line 9: last line: not written whole")),
        "{skipped:?}"
    );
    assert!(
        skipped[3].starts_with(&format!("state journal {journal}: line 8: a change without its end line")),
        "{skipped:?}"
    );
}

#[test]
fn missing_file_is_empty() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut st = StateFile::new(dir.path().join("state.json"));
    assert_eq!(st.load().expect("load"), State::default());
}

#[test]
fn roundtrip_and_format() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("sub/dir/state.json");
    let mut st = StateFile::new(&path);
    st.save(&sample()).expect("save");
    assert_eq!(st.load().expect("load"), sample());
    assert_eq!(v_since(&path), vec!["default/web", "kube-system/dns"]);
    let v: serde_json::Value = serde_json::from_str(&fs::read_to_string(&path).expect("read")).expect("json");
    assert_eq!(v["version"], 1);
    assert_eq!(v["journal"], 1, "the number of this whole write");
    assert_eq!(v["allocations"]["default/web"]["80/TCP"], 20001);
    assert_eq!(v["allocations"]["kube-system/dns"]["53/UDP"], 20002);
    // Overwrite with less: nothing of the old content survives, no temp files left behind.
    st.save(&State::default()).expect("save");
    assert_eq!(st.load().expect("load"), State::default());
    let names: Vec<_> = fs::read_dir(path.parent().expect("parent"))
        .expect("readdir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("state.json")]);
}

#[test]
fn accepts_the_documented_example() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("state.json");
    fs::write(&path, r#"{"version":1,"allocations":{"default/web":{"80/TCP":20001}},"future":true}"#)
        .expect("write");
    let got = StateFile::new(&path).load().expect("load");
    assert_eq!(got.allocations.len(), 1);
}

#[test]
fn corrupt_files_name_the_file() {
    let cases = [
        ("truncated", "{\"version\":1,\"allocations\":{"),
        ("not json", "hello"),
        ("empty", ""),
        ("no version", "{\"allocations\":{}}"),
        ("future version", "{\"version\":2,\"allocations\":{}}"),
        ("allocations not an object", "{\"version\":1,\"allocations\":[]}"),
    ];
    let dir = tempfile::tempdir().expect("tempdir");
    for (name, text) in cases {
        let path = dir.path().join("state.json");
        fs::write(&path, text).expect("write");
        let err = StateFile::new(&path).load().expect_err(name);
        assert!(err.to_string().contains(&path.display().to_string()), "{name}: {err}");
    }
}

/// A bad entry is skipped with a message naming the file and the entry; every good entry next
/// to it is kept, and the agent starts.
#[test]
fn bad_entries_are_skipped_and_named() {
    // (case, bad entry inside "allocations", substring of the message)
    let cases = [
        ("slash in name (written by older versions)", r#""default/a/b":{"80/TCP":20009}"#, "\"default/a/b\""),
        ("no namespace", r#""web":{"80/TCP":20009}"#, "\"web\" is not namespace/name"),
        ("uppercase", r#""default/Web":{"80/TCP":20009}"#, "name \"Web\""),
        ("NUL", r#""default/a\u0000b":{"80/TCP":20009}"#, "\\0"),
        ("ports not an object", r#""default/x":[20009]"#, "not an object"),
        ("bad port id", r#""default/x":{"80/ICMP":20009}"#, "default/x: 80/ICMP"),
        ("node port 0", r#""default/x":{"80/TCP":0}"#, "node port 0 is out of range"),
        ("node port big", r#""default/x":{"80/TCP":70000}"#, "node port 70000"),
        ("negative", r#""default/x":{"80/TCP":-1}"#, "node port -1"),
        ("string", r#""default/x":{"80/TCP":"20009"}"#, "node port \"20009\""),
    ];
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("state.json");
    for (case, entry, needle) in cases {
        let text = format!(r#"{{"version":1,"allocations":{{"default/web":{{"80/TCP":20001}},{entry}}}}}"#);
        fs::write(&path, &text).expect("write");
        let (got, skipped) = StateFile::new(&path).load_lenient().unwrap_or_else(|e| panic!("{case}: {e}"));
        let web = got.allocations.get(&ServiceKey::new("default", "web"));
        assert_eq!(web, Some(&BTreeMap::from([(PortId::tcp(80), 20001)])), "{case}: good entry kept");
        assert!(
            got.allocations.values().all(|m| !m.values().any(|n| *n == 20009)),
            "{case}: bad entry used: {got:?}"
        );
        let messages: Vec<String> = skipped.iter().map(|e| e.to_string()).collect();
        assert_eq!(messages.len(), 1, "{case}: {messages:?}");
        assert!(messages[0].contains(needle), "{case}: {:?} lacks {needle:?}", messages[0]);
        assert!(messages[0].contains(&path.display().to_string()), "{case}: {:?}", messages[0]);
        assert!(StateFile::new(&path).load().is_ok(), "{case}: load fails");
    }
    // Two spellings of one port: the first read is kept, the other skipped.
    fs::write(&path, r#"{"version":1,"allocations":{"default/web":{"80/TCP":20001,"80/tcp":20002}}}"#)
        .expect("write");
    let (got, skipped) = StateFile::new(&path).load_lenient().expect("load");
    assert_eq!(got.allocations[&ServiceKey::new("default", "web")].len(), 1);
    assert!(skipped.len() == 1 && skipped[0].to_string().contains("listed twice"), "{skipped:?}");
}

/// A file written by an older nodelb (no `since`) loads with every allocation; the agent
/// stamps its Services once, keeps the stamps of those that had one, and drops gone ones.
#[test]
fn old_files_migrate_and_stamps_are_kept() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("state.json");
    fs::write(
        &path,
        r#"{"version":1,"allocations":{"default/web":{"80/TCP":20001},"default/db":{"5432/TCP":20002}}}"#,
    )
    .expect("write");
    let mut st = StateFile::new(&path);
    let old = st.load().expect("an old file loads");
    assert_eq!(old.allocations.len(), 2);
    assert!(old.since.is_empty());
    let web = ServiceKey::new("default", "web");
    let db = ServiceKey::new("default", "db");
    let migrated = old.stamp(old.allocations.clone(), t(5));
    assert_eq!(migrated.since, BTreeMap::from([(db.clone(), t(5)), (web.clone(), t(5))]));
    st.save(&migrated).expect("save");
    assert_eq!(st.load().expect("load"), migrated, "round trip with times");
    // Later: db goes, new comes; web keeps its time.
    let mut next = migrated.allocations.clone();
    next.remove(&db);
    let new = ServiceKey::new("default", "new");
    next.insert(new.clone(), BTreeMap::from([(PortId::tcp(80), 20003)]));
    let later = migrated.stamp(next.clone(), t(9));
    assert_eq!(later.since, BTreeMap::from([(new, t(9)), (web.clone(), t(5))]));
    assert_eq!(later.since_of(&web), Some(t(5).to_string()));
    // Bad times are skipped, named, and the allocation stays.
    fs::write(
            &path,
            r#"{"version":1,"allocations":{"default/web":{"80/TCP":20001}},"since":{"default/web":"yesterday","default/gone":"2024-01-01T00:00:00Z"}}"#,
        )
        .expect("write");
    let (got, skipped) = st.load_lenient().expect("load");
    assert_eq!(got.allocations.len(), 1);
    assert!(got.since.is_empty());
    let messages: Vec<String> = skipped.iter().map(|e| e.to_string()).collect();
    assert_eq!(messages.len(), 2, "{messages:?}");
    assert!(
        messages.iter().any(|m| m.contains("since default/web") && m.contains("yesterday")),
        "{messages:?}"
    );
    assert!(messages.iter().any(|m| m.contains("since default/gone")), "{messages:?}");
}

#[test]
fn unreadable_is_an_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A directory where the file should be.
    let mut st = StateFile::new(dir.path());
    assert!(matches!(st.load(), Err(StateError::Read { .. })));
    assert!(matches!(st.save(&sample()), Err(StateError::Write { .. })));
}
