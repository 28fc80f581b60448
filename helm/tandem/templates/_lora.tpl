{{/* LoRA adapters (lora.enabled): every prefill and decode serves the same adapters, read from one volume
(`lora-adapters`, read-only at lora.mountPath): a decode must hold the adapter its prefill computed the KV
under. */}}

{{- define "tandem.lora.volumeName" -}}lora-adapters{{- end -}}

{{/* The flags of `tandem serve`; refuses (one line) what the servers do not run with LoRA yet. */}}
{{- define "tandem.lora.args" -}}
{{- $l := .Values.lora -}}
{{- if $l.enabled }}
{{- include "tandem.lora.check" . }}
- --enable-lora
{{- with $l.adapters }}
- --lora-paths
{{- range . }}
- {{ printf "%s=%s" .name (include "tandem.lora.path" (dict "root" $ "path" .path)) | quote }}
{{- end }}
{{- end }}
- --max-loras-per-batch
- {{ $l.maxLorasPerBatch | quote }}
{{- with $l.maxLoraRank }}
- --max-lora-rank
- {{ . | quote }}
{{- end }}
{{- with $l.targetModules }}
- --lora-target-modules
{{- range . }}
- {{ . }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* An adapter's directory in the pod: its path inside the volume under lora.mountPath. */}}
{{- define "tandem.lora.path" -}}
{{- printf "%s/%s" (trimSuffix "/" .root.Values.lora.mountPath) (trimPrefix "/" .path) | trimSuffix "/" -}}
{{- end -}}

{{/* The chart's own flags that `tandem serve --enable-lora` refuses (common/config_checks.py check_lora). */}}
{{- define "tandem.lora.check" -}}
{{- $v := .Values -}}
{{- range $component := list "prefill" "decode" }}
{{- if gt (int ((index $v $component).tpSize | default 1)) 1 }}
{{- fail (printf "lora.enabled: the servers do not run LoRA at --tp-size > 1 yet; set %s.tpSize=1 or lora.enabled=false" $component) }}
{{- end }}
{{- end }}
{{- if $v.kvStore.enabled }}
{{- fail "lora.enabled: the servers do not run LoRA with the hierarchical cache yet; set kvStore.enabled=false or lora.enabled=false" }}
{{- end }}
{{- if and $v.planner.enabled (eq $v.planner.actuator "flip") }}
{{- fail "lora.enabled: the servers do not run LoRA with --enable-pd-role-switch yet; set planner.actuator=scale or none, or lora.enabled=false" }}
{{- end }}
{{- end -}}

{{- define "tandem.lora.volumes" -}}
{{- $l := .Values.lora -}}
{{- if $l.enabled }}
- name: {{ include "tandem.lora.volumeName" . }}
{{- if eq $l.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ $l.pvc.claimName }}
    readOnly: true
{{- else }}
  hostPath:
    path: {{ $l.hostPath.path }}
    type: Directory
{{- end }}
{{- end }}
{{- end -}}

{{- define "tandem.lora.mounts" -}}
{{- if .Values.lora.enabled }}
- name: {{ include "tandem.lora.volumeName" . }}
  mountPath: {{ .Values.lora.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}
