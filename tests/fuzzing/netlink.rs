//! Targets `nft_dump` and `sock_diag`: arbitrary bytes as the kernel's answers. The nf_tables
//! side takes the messages nodelb's own encoder writes for the good world's ruleset (what a dump
//! of our table looks like) and damages them, or takes raw bytes; the sock_diag side builds
//! `inet_diag_msg` replies and damages them. Properties: a value or an error, never a panic, a
//! loop or a read past the input; what decodes from the undamaged messages is our table.

use arbitrary::Unstructured;
use nodelb::core::decisions::desired::{AllocationMode, SourceNotes};
use nodelb::encode::nft::decode::{self, TableDump};

use super::world::{self, World};

const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_NEWRULE: u16 = 6;
const NFT_MSG_NEWSET: u16 = 9;
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFT_MSG_NEWOBJ: u16 = 18;

/// The good world's ruleset as nodelb encodes it, split into dump sections by message type.
fn good_dump() -> (TableDump, Vec<Vec<u8>>, nodelb::core::ruleset::ir::Ruleset) {
    let world = World::new();
    let (s, e) = world.typed();
    let d = world::compute(AllocationMode::Allocate, &s, &e, &SourceNotes::default(), &world.allocations);
    let enc = nodelb::encode::nft::encode::encode_refs(d.ruleset.full_replace_refs(), 1).expect("encodes");
    let bytes = enc.bytes();
    let mut dump = TableDump::default();
    let mut elements = Vec::new();
    for m in decode::messages(&bytes).expect("our own batch splits") {
        let p = m.payload.to_vec();
        match m.ty & 0xff {
            NFT_MSG_NEWCHAIN => dump.chains.push(p),
            NFT_MSG_NEWRULE => dump.rules.push(p),
            NFT_MSG_NEWSET => dump.sets.push(p),
            NFT_MSG_NEWSETELEM => elements.push(p),
            NFT_MSG_NEWOBJ => dump.objects.push(p),
            _ => {}
        }
    }
    (dump, elements, d.ruleset)
}

thread_local! {
    static GOOD: (TableDump, Vec<Vec<u8>>, nodelb::core::ruleset::ir::Ruleset) = good_dump();
}

/// Damages `msg` a few times: flip, overwrite a length field, truncate, insert, splice.
fn damage(u: &mut Unstructured<'_>, msg: &mut Vec<u8>) -> arbitrary::Result<()> {
    for _ in 0..u.int_in_range(0..=3)? {
        if msg.is_empty() {
            let n = u.int_in_range(0..=8)?;
            msg.extend_from_slice(u.bytes(n)?);
            continue;
        }
        let i = u.choose_index(msg.len())?;
        match u.int_in_range(0..=4)? {
            0 => msg[i] ^= 1 << u.int_in_range(0..=7)?,
            1 => {
                // A length field: the first two bytes of an attribute are its length.
                let v: u16 = u.arbitrary()?;
                let end = (i + 2).min(msg.len());
                msg[i..end].copy_from_slice(&v.to_ne_bytes()[..end - i]);
            }
            2 => msg.truncate(i),
            3 => {
                let n = u.int_in_range(0..=16)?;
                let extra = u.bytes(n)?.to_vec();
                msg.splice(i..i, extra);
            }
            _ => msg[i] = u.arbitrary()?,
        }
    }
    Ok(())
}

pub fn nft_dump(data: &[u8]) {
    let mut u = Unstructured::new(data);
    // Raw bytes as one datagram: splitting, error codes, generation ids.
    let raw = u.peek_bytes(u.len().min(512)).unwrap_or(&[]).to_vec();
    if let Ok(msgs) = decode::messages(&raw) {
        for m in &msgs {
            let _ = decode::error_code(m.payload);
            let _ = decode::gen_id(m.payload);
            let _ = decode::table_of(m.payload);
        }
    }
    let _ = decode::error_code(&raw);
    GOOD.with(|(good, good_elements, ruleset)| {
        let undamaged = u.ratio(1, 8).unwrap_or(false);
        let mut dump = good.clone();
        let mut elements = good_elements.clone();
        if !undamaged {
            for section in
                [&mut dump.chains, &mut dump.rules, &mut dump.sets, &mut dump.objects, &mut elements]
            {
                for msg in section.iter_mut() {
                    if u.ratio(1, 4).unwrap_or(false) && damage(&mut u, msg).is_err() {
                        break;
                    }
                }
                if u.ratio(1, 16).unwrap_or(false) {
                    let raw: Vec<u8> = u.arbitrary().unwrap_or_default();
                    section.push(raw);
                }
            }
        }
        let result = decode::assemble_table("nodelb", &dump, |_set| Ok(elements.clone()));
        match result {
            Ok(table) => {
                // Comparing with what we meant to write must never panic either.
                let _ = nodelb::encode::nft::verify(ruleset, Some(&table));
                if undamaged {
                    assert!(
                        table.problems.iter().all(|p| p.contains("cannot be decoded")),
                        "{:?}",
                        table.problems
                    );
                    assert_eq!(
                        table.chains.len(),
                        ruleset.chains.len(),
                        "chains read back from our own messages"
                    );
                }
            }
            Err(e) => assert!(!undamaged, "our own messages do not decode: {e}"),
        }
    });
}

/// One sock_diag reply message: nlmsghdr + inet_diag_msg (+ attributes).
fn diag_msg(u: &mut Unstructured<'_>) -> arbitrary::Result<Vec<u8>> {
    let ty: u16 = match u.int_in_range(0..=5)? {
        0 => 3, // NLMSG_DONE
        1 => 2, // NLMSG_ERROR
        2 => u.arbitrary()?,
        _ => 20, // SOCK_DIAG_BY_FAMILY
    };
    let mut body = vec![0u8; 72];
    body[0] = *u.choose(&[2u8, 10, 0, 255])?; // family
    body[1] = u.arbitrary()?; // state
    body[4..6].copy_from_slice(&u.arbitrary::<u16>()?.to_be_bytes()); // source port
    body[6..8].copy_from_slice(&u.arbitrary::<u16>()?.to_be_bytes()); // destination port
    if ty == 2 {
        body.truncate(u.int_in_range(0..=20)?);
        let n = body.len().min(4);
        body[..n].copy_from_slice(&[0xf3, 0xff, 0xff, 0xff][..n]);
    }
    if u.ratio(1, 3)? {
        let n = u.int_in_range(0..=24)?;
        body.extend_from_slice(u.bytes(n)?);
    }
    let mut len = (16 + body.len()) as u32;
    if u.ratio(1, 6)? {
        len = u.arbitrary()?;
    }
    let mut msg = Vec::new();
    msg.extend_from_slice(&len.to_ne_bytes());
    msg.extend_from_slice(&ty.to_ne_bytes());
    msg.extend_from_slice(&u.arbitrary::<u16>()?.to_ne_bytes()); // flags
    msg.extend_from_slice(&u.arbitrary::<u32>()?.to_ne_bytes()); // seq
    msg.extend_from_slice(&0u32.to_ne_bytes()); // port id
    msg.extend_from_slice(&body);
    while msg.len() % 4 != 0 {
        msg.push(0);
    }
    Ok(msg)
}

pub fn sock_diag(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let datagram: Vec<u8> = if u.ratio(1, 4).unwrap_or(true) {
        u.take_rest().to_vec()
    } else {
        let mut d = Vec::new();
        for _ in 0..u.int_in_range(1..=6).unwrap_or(1) {
            match diag_msg(&mut u) {
                Ok(m) => d.extend(m),
                Err(_) => break,
            }
        }
        d
    };
    let mut seen = 0usize;
    let _ = nodelb::observe::listeners::decode_datagram(&datagram, "fuzz", &mut |_id| seen += 1);
    // At most one socket per message, and a message is at least 16 bytes.
    assert!(seen <= datagram.len() / 16, "{seen} sockets from {} bytes", datagram.len());
}
