#!/bin/sh
# compose.yaml's minio-init service (the minio/mc image), the only Sluice-side holder of
# MinIO's root credentials: makes the two buckets, the policies of this folder and one user
# per service with its policy, then exits. Safe to run again (restarts, `up` after `down`).
#   models   the model repository: models-reader reads it (workers, controller),
#            models-uploader writes it (models-upload)
#   batches  the batch store (SLUICE_BATCH_STORE): batch-store reads and writes it (gateway,
#            batch worker), and nothing of models
set -eu
export MC_CONFIG_DIR=/tmp/mc
here=${0%/*}

mc alias set sluice "$S3_ENDPOINT_URL" "$MINIO_ROOT_USER" "$MINIO_ROOT_PASSWORD" >/dev/null
mc mb --ignore-existing sluice/models sluice/batches

for policy in models-read models-write batch-store; do
    mc admin policy create sluice "sluice-$policy" "$here/$policy.json" >/dev/null
done

# user ACCESS_KEY SECRET_KEY POLICY
user() {
    mc admin user add sluice "$1" "$2" >/dev/null
    if ! out=$(mc admin policy attach sluice "sluice-$3" --user "$1" 2>&1); then
        case $out in
            *"already in effect"* | *"already attached"*) ;;
            *)
                echo "$out" >&2
                exit 1
                ;;
        esac
    fi
    echo "MinIO user $1: policy sluice-$3"
}

user "$MODELS_READER_ACCESS_KEY" "$MODELS_READER_SECRET_KEY" models-read
user "$MODELS_UPLOADER_ACCESS_KEY" "$MODELS_UPLOADER_SECRET_KEY" models-write
user "$BATCH_STORE_ACCESS_KEY" "$BATCH_STORE_SECRET_KEY" batch-store
