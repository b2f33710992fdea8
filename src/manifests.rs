//! The manifests directory (placeholder).
