{{/* Names, labels and the pieces every Sluice container shares. */}}

{{- define "sluice.fullname" -}}
{{- if contains "sluice" .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-sluice" .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "sluice.selectorLabels" -}}
app.kubernetes.io/name: sluice
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "sluice.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "sluice.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "sluice.image" -}}
{{- printf "%s:%s" .repository (toString .tag) -}}
{{- end -}}

{{/* A worker Deployment's name: (list $ $model). Names that had to be changed to fit
     Kubernetes' rules, or shortened, end with a hash of the model version. */}}
{{- define "sluice.workerName" -}}
{{- $ctx := index . 0 -}}
{{- $m := index . 1 -}}
{{- $safe := regexReplaceAll "[^a-z0-9-]+" ($m.name | toString | lower) "-" | trimAll "-" -}}
{{- $base := printf "%s-worker-%s-v%v" (include "sluice.fullname" $ctx) $safe $m.version -}}
{{- if or (ne $safe (toString $m.name)) (gt (len $base) 63) -}}
{{- printf "%s-%s" ($base | trunc 56 | trimSuffix "-") (printf "%s:%v" $m.name $m.version | sha256sum | trunc 6) -}}
{{- else -}}
{{- $base -}}
{{- end -}}
{{- end -}}

{{/* The model name as a label value (the exact name is in the sluice.dev/model annotation). */}}
{{- define "sluice.modelLabel" -}}
{{- regexReplaceAll "[^A-Za-z0-9._-]+" (toString .) "-" | trunc 63 | trimAll "-._" -}}
{{- end -}}

{{/* A request stream of a model version: (list $ $model $suffix), suffix "", ":p<N>" or
     ":bg". The key layout of sluice/keys.py (Keys.request_stream, background_stream): the
     model in braces is the Redis Cluster hash tag, so a model's keys share one slot. */}}
{{- define "sluice.requestStream" -}}
{{- $ctx := index . 0 -}}
{{- $m := index . 1 -}}
{{- printf "%s:req:{%s}:%v%s" $ctx.Values.namespace $m.name $m.version (index . 2) -}}
{{- end -}}

{{/* Where a worker reads the repository: the image's directory, or the copy its init
     container made of an s3:// repository. */}}
{{- define "sluice.isS3" -}}
{{- if hasPrefix "s3://" .Values.modelRepository.url -}}true{{- end -}}
{{- end -}}

{{- define "sluice.env" -}}
{{- if .Values.redis.existingSecret }}
- name: SLUICE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingSecret }}
      key: {{ .Values.redis.urlKey }}
{{- else }}
- name: SLUICE_REDIS_URL
  value: {{ .Values.redis.url | quote }}
{{- end }}
- name: SLUICE_NAMESPACE
  value: {{ .Values.namespace | quote }}
{{- with .Values.modelRepository.s3.endpointUrl }}
- name: SLUICE_S3_ENDPOINT_URL
  value: {{ . | quote }}
{{- end }}
{{- with .Values.modelRepository.s3.region }}
- name: SLUICE_S3_REGION
  value: {{ . | quote }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "sluice.envFrom" -}}
{{- with .Values.modelRepository.s3.credentialsSecret }}
envFrom:
  - secretRef:
      name: {{ . }}
{{- end }}
{{- end -}}

{{/* The Secret holding the gateways' API keys (api-keys, admin-keys). */}}
{{- define "sluice.apiKeysSecret" -}}
{{- .Values.apiKeys.existingSecret | default (printf "%s-api-keys" (include "sluice.fullname" .)) -}}
{{- end -}}

{{/* Writable places of a read-only container: /tmp, always. */}}
{{- define "sluice.tmpMount" -}}
- name: tmp
  mountPath: /tmp
{{- end -}}

{{- define "sluice.tmpVolume" -}}
- name: tmp
  emptyDir: {}
{{- end -}}
