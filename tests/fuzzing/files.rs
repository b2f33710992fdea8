//! Targets `manifests` and `state_file`: arbitrary bytes as a file nodelb reads from disk. A
//! manifest file lands next to a good one in a manifests directory (`manifests::load_dir`, then
//! the last-good substitution and `desired::compute`, as the agent does); a state file is loaded
//! (`StateFile::load_lenient`), written back and loaded again, then used as the allocator's memory.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Service;
use nodelb::core::decisions::desired::{AllocationMode, Desired, SourceNotes};
use nodelb::core::inputs::compact::EndpointSlice;
use nodelb::core::inputs::manifests::{LastGood, Manifests};
use nodelb::observe::state::StateFile;

use super::world::{self, GOOD_NS, World};

struct Dirs {
    _tmp: tempfile::TempDir,
    manifests: PathBuf,
    state: PathBuf,
}

thread_local! {
    static DIRS: Dirs = {
        let tmp = tempfile::tempdir().expect("temp dir");
        let manifests = tmp.path().join("manifests");
        std::fs::create_dir(&manifests).expect("mkdir");
        let world = World::new();
        let docs: Vec<String> = world.services.iter().chain(&world.slices)
            .map(|v| serde_saphyr::to_string(v).expect("yaml")).collect();
        std::fs::write(manifests.join("good.yaml"), docs.join("---\n")).expect("write good.yaml");
        let state = tmp.path().join("state.json");
        Dirs { _tmp: tmp, manifests, state }
    };
    static ALONE: RefCell<Option<Desired>> = const { RefCell::new(None) };
}

fn compute(m: &Manifests, world: &World) -> Desired {
    let services: Vec<Service> = m.services.iter().map(|s| Service::clone(s)).collect();
    let slices: Vec<EndpointSlice> = m.slices.iter().map(|s| EndpointSlice::clone(s)).collect();
    let notes = SourceNotes { refused: vec![], stale: m.stale.clone() };
    world::compute(AllocationMode::Allocate, &services, &slices, &notes, &world.allocations)
}

fn in_good_namespace(m: &Manifests, hostile: &Path) -> bool {
    let from_hostile = m.files.get(hostile);
    from_hostile.is_some_and(|f| {
        f.services.iter().any(|s| s.metadata.namespace.as_deref() == Some(GOOD_NS))
            || f.slices.iter().any(|s| s.metadata.namespace.as_deref() == Some(GOOD_NS))
    })
}

pub fn manifests(data: &[u8]) {
    // JSON files take another parser: text that starts like JSON goes into `h.json`.
    let json = data.iter().find(|b| !b.is_ascii_whitespace()).is_some_and(|b| matches!(b, b'{' | b'['));
    let (name, bytes) = (if json { "h.json" } else { "h.yaml" }, data);
    DIRS.with(|dirs| {
        for f in ["h.json", "h.yaml"] {
            let _ = std::fs::remove_file(dirs.manifests.join(f));
        }
        let hostile = dirs.manifests.join(name);
        std::fs::write(&hostile, bytes).expect("write");
        let world = World::new();
        let m = nodelb::observe::manifest_dir::load_dir(&dirs.manifests).expect("the directory is readable");
        for p in &m.problems {
            assert_eq!(p.file, hostile, "a problem not about the hostile file: {p}");
            assert!(
                p.to_string().len() <= world::MAX_MESSAGE,
                "problem message of {} bytes",
                p.to_string().len()
            );
        }
        let good: BTreeSet<_> = world.keys();
        let served: BTreeSet<_> =
            m.services.iter().map(|s| nodelb::core::inputs::model::service_key(s)).collect();
        assert!(good.is_subset(&served), "the good file's Services are not all read: {served:?}");
        let mut last_good = LastGood::default();
        let m = last_good.apply(m);
        let with = compute(&m, &world);
        world::assert_messages_bounded(&with, "manifests");
        let alone = ALONE.with(|a| {
            a.borrow_mut()
                .get_or_insert_with(|| {
                    let _ = std::fs::remove_file(&hostile);
                    let m = nodelb::observe::manifest_dir::load_dir(&dirs.manifests).expect("readable");
                    assert!(m.problems.is_empty(), "{:?}", m.problems);
                    compute(&m, &world)
                })
                .clone()
        });
        world::assert_ruleset_sound(&alone.ruleset, &with, "manifests");
        if !in_good_namespace(&m, &hostile) {
            world::assert_good_served(&world, &alone, &with, "manifests");
        }
    });
}

pub fn state_file(data: &[u8]) {
    DIRS.with(|dirs| {
        std::fs::write(&dirs.state, data).expect("write");
        let mut file = StateFile::new(&dirs.state);
        let (state, skipped) = match file.load_lenient() {
            Ok(x) => x,
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.contains(&dirs.state.display().to_string()), "error names no file: {msg}");
                assert!(msg.len() <= world::MAX_MESSAGE, "error of {} bytes", msg.len());
                return;
            }
        };
        for e in &skipped {
            let msg = e.to_string();
            assert!(msg.contains(&dirs.state.display().to_string()), "skipped entry names no file: {msg}");
            assert!(msg.len() <= world::MAX_MESSAGE, "skipped-entry message of {} bytes", msg.len());
        }
        // What was read is what is written back: a save and a load are the identity.
        let mut copy = StateFile::new(dirs.state.with_extension("copy"));
        copy.save(&state).expect("save");
        let (again, skipped_again) = copy.load_lenient().expect("our own file loads");
        assert!(skipped_again.is_empty(), "our own file has bad entries: {skipped_again:?}");
        assert_eq!(again, state, "save then load changed the state");
        // Used as the allocator's memory, it cannot take the good Services' ports: their own
        // annotation comes first.
        let world = World::new();
        let (s, e) = world.typed();
        let notes = SourceNotes::default();
        let alone = world::compute(AllocationMode::Allocate, &s, &e, &notes, &world.allocations);
        let with = world::compute(AllocationMode::Allocate, &s, &e, &notes, &state.allocations);
        world::assert_good_served(&world, &alone, &with, "state file");
    });
}
