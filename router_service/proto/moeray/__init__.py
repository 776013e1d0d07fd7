"""Generated protobuf / gRPC stubs of the public moeray API (see moeray/v1/moeray.proto)."""
