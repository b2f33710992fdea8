//! Reading a file someone else may have written, with a size bound: a file that is larger (a
//! mistake, a runaway generator, a symlink to something huge) is an error that says its size,
//! and never more than the bound plus one byte is read into memory.

use std::io::{self, Read as _};
use std::path::Path;

/// The file's text, or an error: `FileTooLarge` ("is N bytes, more than MAX") when it holds more than
/// `max` bytes, `InvalidData` when it is not UTF-8, or the error opening or reading it.
pub fn read_to_string(path: &Path, max: u64) -> io::Result<String> {
    let file = std::fs::File::open(path)?;
    let mut bytes = Vec::new();
    file.take(max + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        // The whole size, for the message (the file may still be growing: at least this much).
        let size = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0).max(max + 1);
        return Err(io::Error::new(io::ErrorKind::FileTooLarge, format!("is {size} bytes, more than {max}")));
    }
    String::from_utf8(bytes).map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "is not UTF-8 text"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_up_to_the_bound_and_says_the_size_beyond() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("f");
        std::fs::write(&path, "0123456789").expect("write");
        assert_eq!(read_to_string(&path, 10).expect("fits"), "0123456789");
        let e = read_to_string(&path, 9).expect_err("too large");
        assert_eq!(e.kind(), io::ErrorKind::FileTooLarge);
        assert_eq!(e.to_string(), "is 10 bytes, more than 9");
        std::fs::write(&path, [0xff, 0xfe]).expect("write");
        assert_eq!(read_to_string(&path, 9).expect_err("binary").to_string(), "is not UTF-8 text");
        assert_eq!(
            read_to_string(&dir.path().join("missing"), 9).expect_err("missing").kind(),
            io::ErrorKind::NotFound
        );
    }
}
