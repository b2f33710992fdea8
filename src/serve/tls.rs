//! TLS for the authenticated metrics listener (`--metrics-addr`): a bearer token crosses the
//! network there, so it is never sent in clear text. The certificate is the operator's
//! (`--metrics-tls-cert-file`/`--metrics-tls-key-file`, PEM, read at start) or, by default, a
//! self-signed one generated at start and kept in memory only, as controller-runtime's secure
//! metrics server and kube-rbac-proxy do; scrapers then skip verification (`insecureSkipVerify`
//! in the PodMonitor) and rely on the token for who they are talking to being the agent.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio_rustls::rustls::{self, ServerConfig};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: rustls_pki_types::pem::Error },
    #[error("{path}: no certificate in it")]
    NoCertificate { path: PathBuf },
    #[error("cannot generate a self-signed certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
}

fn read_error(path: &Path) -> impl Fn(rustls_pki_types::pem::Error) -> TlsError + '_ {
    move |source| TlsError::Read { path: path.to_path_buf(), source }
}

/// The server configuration: from the given PEM files, else self-signed for `names` (the
/// certificate's subject alternative names: the node name, `localhost`).
pub fn server_config(files: Option<(&Path, &Path)>, names: &[String]) -> Result<Arc<ServerConfig>, TlsError> {
    let (certs, key) = match files {
        Some((cert, key)) => {
            let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
                .map_err(read_error(cert))?
                .collect::<Result<_, _>>()
                .map_err(read_error(cert))?;
            if certs.is_empty() {
                return Err(TlsError::NoCertificate { path: cert.to_path_buf() });
            }
            (certs, PrivateKeyDer::from_pem_file(key).map_err(read_error(key))?)
        }
        None => {
            let generated = rcgen::generate_simple_self_signed(names.to_vec())?;
            let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(generated.signing_key.serialize_der()));
            (vec![generated.cert.der().clone()], key)
        }
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The operator's PEM files are used; unreadable or empty ones are errors naming the file;
    /// without files a self-signed certificate is made.
    #[test]
    fn certificates_from_files_or_self_signed() {
        let dir = tempfile::tempdir().expect("dir");
        let made = rcgen::generate_simple_self_signed(vec!["node-1".to_string()]).expect("cert");
        let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        std::fs::write(&cert, made.cert.pem()).expect("write");
        std::fs::write(&key, made.signing_key.serialize_pem()).expect("write");
        server_config(Some((&cert, &key)), &[]).expect("PEM files");
        server_config(None, &["node-1".into(), "localhost".into()]).expect("self-signed");
        let missing = dir.path().join("missing.crt");
        let e = server_config(Some((&missing, &key)), &[]).expect_err("missing").to_string();
        assert!(e.contains("missing.crt"), "{e}");
        let empty = dir.path().join("empty.crt");
        std::fs::write(&empty, "").expect("write");
        let e = server_config(Some((&empty, &key)), &[]).expect_err("empty").to_string();
        assert!(e.contains("empty.crt") && e.contains("no certificate"), "{e}");
        let e = server_config(Some((&cert, &cert)), &[]).expect_err("a certificate as the key").to_string();
        assert!(e.contains("tls.crt"), "{e}");
    }
}
