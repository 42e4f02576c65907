//! Proto3 canonical JSON for `KvEventBatch` bytes, via the descriptor set compiled from `proto/`
//! (`prost-reflect`), so the output follows the JSON mapping exactly: lowerCamelCase names,
//! 64-bit integers as strings, enum names, defaults omitted.

use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor};

/// Turns encoded batches into JSON lines.
pub struct BatchPrinter {
    desc: MessageDescriptor,
}

impl BatchPrinter {
    /// A printer for `smg.grpc.common.KvEventBatch`.
    pub fn new() -> Self {
        let pool = DescriptorPool::decode(crate::proto::FILE_DESCRIPTOR_SET)
            .expect("embedded descriptor set is valid");
        let desc = pool
            .get_message_by_name("smg.grpc.common.KvEventBatch")
            .expect("KvEventBatch is in the descriptor set");
        BatchPrinter { desc }
    }

    /// One line of canonical JSON for an encoded batch.
    pub fn to_json(&self, bytes: &[u8]) -> Result<String, String> {
        let msg = DynamicMessage::decode(self.desc.clone(), bytes)
            .map_err(|e| format!("undecodable batch: {e}"))?;
        serde_json::to_string(&msg).map_err(|e| e.to_string())
    }
}

impl Default for BatchPrinter {
    fn default() -> Self {
        Self::new()
    }
}
