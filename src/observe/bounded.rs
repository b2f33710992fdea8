//! Reading a file someone else may have written, with a size bound: a file that is larger (a
//! mistake, a runaway generator, a symlink to something huge) is an error that says its size,
//! and never more than the bound plus one byte is read into memory. Only a regular file is read:
//! the file is opened without blocking and its type checked on the opened descriptor, so a FIFO,
//! a socket or a device in its place is an error at once, never a read that waits forever.

use std::io::{self, Read as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;

/// The file's text, or an error: `FileTooLarge` ("is N bytes, more than MAX") when it holds more than
/// `max` bytes, `InvalidData` when it is not UTF-8, `InvalidInput` when it is not a regular file,
/// or the error opening or reading it. Symbolic links are followed (a ConfigMap's files are links).
pub fn read_to_string(path: &Path, max: u64) -> io::Result<String> {
    read(path, max, 0)
}

/// [`read_to_string`] of a file of the agent's own (its state file): a symbolic link in its place
/// is not followed but refused (`ELOOP`).
pub fn read_own(path: &Path, max: u64) -> io::Result<String> {
    read(path, max, libc::O_NOFOLLOW)
}

fn read(path: &Path, max: u64, flags: i32) -> io::Result<String> {
    let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK | flags).open(path)?;
    let kind = file.metadata()?.file_type();
    if !kind.is_file() {
        use std::os::unix::fs::FileTypeExt as _;
        let what = if kind.is_fifo() {
            "a FIFO"
        } else if kind.is_socket() {
            "a socket"
        } else if kind.is_block_device() || kind.is_char_device() {
            "a device"
        } else if kind.is_dir() {
            "a directory"
        } else {
            "not a file"
        };
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("is {what}, not a regular file")));
    }
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

    /// A FIFO with no writer (a read of it would wait forever), a socket and a directory are
    /// errors at once; a link is followed for others' files, refused for the agent's own.
    #[test]
    fn only_regular_files_are_read_and_own_files_are_not_links() {
        let dir = tempfile::tempdir().expect("dir");
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).expect("mkfifo");
        let started = std::time::Instant::now();
        let e = read_to_string(&fifo, 9).expect_err("a FIFO");
        assert_eq!(e.to_string(), "is a FIFO, not a regular file");
        assert!(started.elapsed() < std::time::Duration::from_secs(1), "did not wait for a writer");
        // Opening a socket file fails itself (ENXIO) on Linux: either way it is not read.
        let _socket = std::os::unix::net::UnixListener::bind(dir.path().join("sock")).expect("socket");
        assert!(read_to_string(&dir.path().join("sock"), 9).is_err());
        assert_eq!(
            read_to_string(dir.path(), 9).expect_err("a directory").kind(),
            io::ErrorKind::InvalidInput
        );
        let target = dir.path().join("target");
        std::fs::write(&target, "x").expect("write");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&target, &link).expect("symlink");
        assert_eq!(read_to_string(&link, 9).expect("followed"), "x");
        let e = read_own(&link, 9).expect_err("not followed");
        assert_eq!(e.raw_os_error(), Some(libc::ELOOP), "{e}");
    }
}
